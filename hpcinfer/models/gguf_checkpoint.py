"""Read a GGUF file (llama.cpp's format) as a decoder checkpoint, with `gguf`, llama.cpp's own reader.

The file's metadata becomes the HF-style config the native decoder validates (so a GGUF and a
safetensors checkpoint of one model build the same `DecoderConfig`), its tokenizer metadata becomes
a fast tokenizer (gguf_tokenizer.py), and its tensors are dequantized one at a time, from the
memory-mapped file, into the decoder's own names: the quantized file is never copied into memory
and the float weights exist once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from .gguf_dequantize import torch_dequantize
from .gguf_header import read_header

# GGUF `general.architecture` -> the HF architecture whose native decoder runs it. Mistral files
# say "llama". llama.cpp's converter permutes Llama's q/k rows for its rotary layout; Qwen's not.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
_PERMUTED_QK = {"llama", "mistral", "mixtral"}  # native decoder families

_LAYER_TENSORS = {  # GGUF name inside blk.N -> (native name, position in a fused tensor or None)
    "attn_q": ("qkv", 0),
    "attn_k": ("qkv", 1),
    "attn_v": ("qkv", 2),
    "ffn_gate": ("gate_up", 0),
    "ffn_up": ("gate_up", 1),
    "attn_output": ("o_proj", None),
    "ffn_down": ("down", None),
}
_LAYER_NORMS = {
    "attn_norm": "input_norm",
    "ffn_norm": "post_norm",  # before the MLP
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "attn_out_norm",  # Gemma's norms after attention and after the MLP
    "post_ffw_norm": "mlp_out_norm",
}
# a mixture of experts' tensors, stacked over the experts ([experts, rows, columns]) as MoE holds them
_EXPERT_TENSORS = {"ffn_gate_inp": ("router", None), "ffn_gate_exps": ("gate_up", 0), "ffn_up_exps": ("gate_up", 1)}
_EXPERT_TENSORS |= {"ffn_down_exps": ("down", None)}
# phi3 files keep HF's fused q/k/v (attn_qkv) and gate/up (in ffn_up): whole tensors of ours
_FUSED_AS_STORED = {"phi3": {"attn_qkv": "qkv", "ffn_up": "gate_up"}}
# gpt-oss's own tensors: sinks, the biases of its router and experts, and its norm before the MLP
# (named post_attention_norm, as transformers names it; Gemma's of that name follows attention)
_GPT_OSS = {
    "attn_sinks.weight": ("sinks", None),
    "post_attention_norm.weight": ("post_norm", None),
    "ffn_gate_inp.bias": ("moe.router_bias", None),
    "ffn_gate_exps.bias": ("moe.gate_up_bias", 0),
    "ffn_up_exps.bias": ("moe.gate_up_bias", 1),
    "ffn_down_exps.bias": ("moe.down_bias", None),
}
_TOP = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm", "output.weight": "lm_head.weight"}


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory without config.json."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ModelError(
            f"directory holds {len(found)} GGUF files; name one ({', '.join(f.name for f in found)})", path=str(path)
        )
    return found[0] if found else None


class GGUFFile:
    """One open GGUF file: its metadata as plain values and its tensors by name, memory-mapped."""

    def __init__(self, file: Path) -> None:
        self.file = file
        try:
            header = read_header(file)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            raise ModelError(f"cannot read GGUF file ({exc})", path=str(file)) from None
        self.fields, self.tensors = header.metadata, header.tensors
        self._data = np.memmap(file, dtype=np.uint8, mode="r", offset=header.data_offset)

    def value(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def metadata(self, prefix: str = "") -> dict[str, Any]:
        return {key: value for key, value in self.fields.items() if key.startswith(prefix)}

    def hf_config(self) -> dict[str, Any]:
        """The config.json a HF checkpoint of this model would carry, from llama.cpp's keys."""
        arch = str(self.value("general.architecture"))
        if arch not in ARCHITECTURES:
            raise ModelError(
                f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})", path=str(self.file)
            )
        if "rope_freqs.weight" in self.tensors:
            raise ModelError("GGUF rope_freqs (per-dimension RoPE factors) are not supported", path=str(self.file))
        if "rope_factors_short.weight" in self.tensors and arch != "phi3":
            raise ModelError(f"GGUF LongRoPE factors on {arch} are not supported", path=str(self.file))

        def key(name: str, default: Any = None) -> Any:
            return self.value(f"{arch}.{name}", default)

        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        tokens = self.value("tokenizer.ggml.tokens") or []
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch]],
            "vocab_size": int(key("vocab_size") or len(tokens)),
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": int(key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(key("attention.head_count_kv") or heads),
            "head_dim": int(key("attention.key_length") or hidden // heads),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(key("context_length", 2048)),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }
        scaling = key("rope.scaling.type")
        if scaling and scaling != "none":
            config["rope_scaling"] = {
                "rope_type": str(scaling),
                "factor": float(key("rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length", 0)) or None,
            }
        if arch == "llama" and "blk.0.attn_q.bias" in self.tensors:
            config["attention_bias"] = True
        if arch == "phi3":
            self._phi3(config, key)
        if arch in ("gemma2", "gemma3"):
            self._gemma(arch, config, key)
        if arch == "qwen3moe":
            # NOTE: llama.cpp runs every layer as experts and renormalises the chosen experts' weights
            config["num_experts"] = int(key("expert_count"))
            config["num_experts_per_tok"] = int(key("expert_used_count"))
            config["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
            config["norm_topk_prob"] = True
        if arch == "gpt-oss":
            self._gpt_oss(config, key)
        if arch == "llama" and key("expert_count"):  # Mixtral: llama.cpp writes it as a llama with experts
            if "blk.0.ffn_gate_exps.weight" not in self.tensors:
                raise ModelError("GGUF experts stored one tensor each (an older converter's layout) are not supported; "
                                 "reconvert with a current llama.cpp", path=str(self.file))  # fmt: skip
            config["architectures"] = ["MixtralForCausalLM"]
            config["num_local_experts"] = int(key("expert_count"))
            config["num_experts_per_tok"] = int(key("expert_used_count"))
        return config

    def _gemma(self, arch: str, config: dict[str, Any], key: Any) -> None:
        """Gemma 2 and 3 as llama.cpp runs their files: the window and Gemma 2's soft caps from the
        file; one global layer in two (Gemma 2) or six (Gemma 3), Gemma 3's local RoPE base 10,000,
        and queries scaled by 1/sqrt(head_dim) (by 1/sqrt(hidden / heads) for the 27B models: 46 or
        62 layers), none of which the file stores. Its norms already hold (1 + weight): llama.cpp's
        converter adds the 1, so the loader does not."""
        config["sliding_window"] = int(key("attention.sliding_window", 4096))
        layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
        config["query_pre_attn_scalar"] = hidden // heads if layers in (46, 62) else config["head_dim"]
        if arch == "gemma3":
            config["sliding_window_pattern"] = 6
            config["rope_local_base_freq"] = 10_000.0
            return
        config["attn_logit_softcapping"] = key("attn_logit_softcapping")
        config["final_logit_softcapping"] = key("final_logit_softcapping")

    def _gpt_oss(self, config: dict[str, Any], key: Any) -> None:
        """gpt-oss as llama.cpp's converter writes it: experts in every layer, their width in
        `expert_feed_forward_length`, the window of its sliding layers (every other one, the first
        included, as llama.cpp and transformers alternate them), biased attention, the SwiGLU clamp
        (7 where the file has none, llama.cpp's constant), and YaRN with its correction range left
        unrounded, as gpt-oss's reference and transformers run it (the file does not say)."""
        config["num_local_experts"] = int(key("expert_count"))
        config["num_experts_per_tok"] = int(key("expert_used_count"))
        config["intermediate_size"] = int(key("expert_feed_forward_length") or config["intermediate_size"])
        config["sliding_window"] = int(key("attention.sliding_window", 128))
        config["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        clamp = key("swiglu_clamp_exp")
        config["swiglu_limit"] = float((clamp[0] if isinstance(clamp, list) else clamp) or 7.0)
        rope = config.get("rope_scaling")
        if rope and rope["rope_type"] == "yarn":
            rope["beta_fast"] = float(key("rope.scaling.yarn_beta_fast", 32.0))
            rope["beta_slow"] = float(key("rope.scaling.yarn_beta_slow", 1.0))
            rope["truncate"] = False

    def _phi3(self, config: dict[str, Any], key: Any) -> None:
        """Phi-3's partial rotary dimensions and LongRoPE factors, as llama.cpp's converter stores them
        (`rope.dimension_count`; `rope_factors_short` / `rope_factors_long` tensors beside
        `rope.scaling.original_context_length` and `rope.scaling.attn_factor`)."""
        rotary = key("rope.dimension_count")
        if rotary:
            config["partial_rotary_factor"] = int(rotary) / config["head_dim"]
        if "rope_factors_short.weight" in self.tensors:
            config["rope_scaling"] = {
                "rope_type": "longrope",
                "short_factor": self.float_tensor("rope_factors_short.weight").tolist(),
                "long_factor": self.float_tensor("rope_factors_long.weight").tolist(),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            }
            if key("rope.scaling.attn_factor") is not None:
                config["rope_scaling"]["attention_factor"] = float(key("rope.scaling.attn_factor"))

    def eos_token_ids(self) -> tuple[int, ...]:
        ids = [self.value(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def special_tokens(self) -> dict[str, str]:
        tokens = self.value("tokenizer.ggml.tokens")
        if not tokens:
            return {}
        out = {}
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        ):
            index = self.value(f"tokenizer.ggml.{key}_token_id")
            if index is not None and 0 <= int(index) < len(tokens):
                out[name] = tokens[int(index)]
        return out

    def float_tensor(self, name: str) -> torch.Tensor:
        """One tensor dequantized to float32 ([out, in] for a matrix), read from the mapped file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        try:
            kind = GGMLQuantizationType(tensor.tensor_type)
            block, size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            from importlib.metadata import version

            raise ModelError(  # NOTE: newer types (MXFP4: gpt-oss) came in newer gguf releases
                f"GGUF tensor type {tensor.tensor_type} is unknown to gguf {version('gguf')} (tensor {name}; "
                "a newer gguf may read it: pip install -U gguf)",
                path=str(self.file),
            ) from None
        row_bytes = tensor.shape[0] // block * size  # one row: the innermost dimension, as stored
        rows = int(np.prod(tensor.shape[1:], dtype=np.int64))
        raw = self._data[tensor.offset : tensor.offset + rows * row_bytes].reshape(rows, row_bytes)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if (fast := torch_dequantize(raw, kind.name)) is not None:
            return fast.reshape(shape)
        try:
            array = dequantize(raw, kind)
        except NotImplementedError:  # gguf's answer for a type it names but has no dequantizer for (Q8_1, Q8_K, I8)
            raise ModelError(
                f"GGUF tensor type {kind.name} is not supported (tensor {name}): the gguf package has no "
                "dequantizer for it; convert the file with another type (Q8_0, Q4_K, F16)",
                path=str(self.file),
            ) from None
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
        # An F32 tensor comes back as a read-only view of the mapped file: copy it into the model's own memory.
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    def native_tensors(self, arch: str, heads: int, kv_heads: int) -> Iterator[tuple[str, torch.Tensor, int | None]]:
        """(native name, float32 tensor, position in a fused tensor) for every tensor the decoder uses."""
        for name in self.tensors:
            if name in _TOP:
                yield _TOP[name], self.float_tensor(name), None
                continue
            block, _, rest = name.partition(".")
            layer, _, rest = rest.partition(".")
            if block != "blk" or not layer.isdigit():
                continue
            module, _, kind = rest.rpartition(".")
            if arch == "gpt_oss" and rest in _GPT_OSS:
                target, position = _GPT_OSS[rest]
                yield f"layers.{layer}.{target}", self.float_tensor(name), position
            elif module in _EXPERT_TENSORS and kind == "weight":
                target, position = _EXPERT_TENSORS[module]
                yield f"layers.{layer}.moe.{target}", self.float_tensor(name), position
            elif module in (stored := _FUSED_AS_STORED.get(arch, {})):
                yield f"layers.{layer}.{stored[module]}.{kind}", self.float_tensor(name), None
            elif module in _LAYER_NORMS and kind == "weight":
                yield f"layers.{layer}.{_LAYER_NORMS[module]}", self.float_tensor(name), None
            elif module in _LAYER_TENSORS:
                target, position = _LAYER_TENSORS[module]
                tensor = self.float_tensor(name)
                if arch in _PERMUTED_QK and module in ("attn_q", "attn_k"):
                    tensor = unpermute_rotary(tensor, heads if module == "attn_q" else kv_heads)
                yield f"layers.{layer}.{target}.{kind}", tensor, position


def unpermute_rotary(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row order (each head's halves interleaved) back to HF's rotate-half order."""
    rows = tensor.shape[0]
    half = rows // heads // 2
    return tensor.reshape(heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


__all__ = ["ARCHITECTURES", "GGUFFile", "find_gguf", "unpermute_rotary"]
