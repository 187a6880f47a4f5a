"""Load a causal LM from its checkpoint (decoder_inspect.DecoderInfo): (sharded) safetensors or GGUF
weights mapped onto LlamaDecoder, in FP8 or int8 on request; its tokenizer.

NOTE: as for encoders, nothing in a model directory is imported or executed: weights load through
safetensors only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ..errors import ConfigError, ModelError
from .decoder_config import ARCHITECTURES
from .decoder_inspect import DecoderInfo, open_gguf, weight_files
from .decoder_int8 import PROBE_TEXT, int8_checked
from .fp8 import quantize_decoder_fp8
from .gguf_tokenizer import gguf_tokenizer
from .int8_kernels import int8_problem
from .llama import LlamaDecoder
from .meta import empty_modules
from .moe import MoE
from .mxfp4 import dequantize_mxfp4
from .vlm import text_weights


def load_tokenizer(info: DecoderInfo) -> Tokenizer:
    """The checkpoint's fast tokenizer: its tokenizer.json, or rebuilt from a GGUF's metadata; with no
    truncation or padding, whatever its files say (a prompt is checked against the context, never cut)."""
    try:
        tokenizer = (
            gguf_tokenizer(open_gguf(info.path).metadata("tokenizer.ggml."))
            if info.gguf
            else Tokenizer.from_file(str(info.path / "tokenizer.json"))
        )
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot load tokenizer ({exc})", path=str(info.path)) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# a mixture of experts: Qwen3-MoE's `mlp.experts.E.{gate,up,down}_proj`, Mixtral's
# `block_sparse_moe.experts.E.{w1,w3,w2}`, stacked per layer into MoE's [experts, ...] tensors;
# transformers 5 may also save them stacked already (`mlp.experts.gate_up_proj`, `...down_proj`)
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MOE_DIRECT = {
    "mlp.gate.weight": "moe.router",
    "block_sparse_moe.gate.weight": "moe.router",
    "mlp.experts.gate_up_proj": "moe.gate_up",
    "mlp.experts.down_proj": "moe.down",
}
_DIRECT = {
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.o_proj.bias": "o_proj.bias",
    "mlp.down_proj.weight": "down.weight",
    "mlp.down_proj.bias": "down.bias",
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    # phi3 stores q/k/v and gate/up fused, in the order this model runs them: kept as they are
    "self_attn.qkv_proj.weight": "qkv.weight",
    "mlp.gate_up_proj.weight": "gate_up.weight",
}
_FUSED = {  # HF name -> (native fused name, position in the concatenation)
    "self_attn.q_proj": ("qkv", 0),
    "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2),
    "mlp.gate_proj": ("gate_up", 0),
    "mlp.up_proj": ("gate_up", 1),
}


# Gemma's norms: the one before the MLP is `pre_feedforward_layernorm`, and post_attention_layernorm
# normalises the attention's output, as post_feedforward_layernorm does the MLP's
_GEMMA_NORMS = {
    "post_attention_layernorm.weight": "attn_out_norm",
    "pre_feedforward_layernorm.weight": "post_norm",
    "post_feedforward_layernorm.weight": "mlp_out_norm",
}


def _gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate/up, interleaved along dim 1 (gate, up, gate, ...), as MoE's gate rows then up rows."""
    return torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1).contiguous()


def _gpt_oss(rest: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """A gpt-oss layer tensor under MoE's name and layout, or None for one shared with Llama's:
    its experts are stored [experts, in, out] with gate and up interleaved column by column."""
    if rest == "self_attn.sinks":
        return "sinks", tensor
    if rest in ("mlp.router.weight", "mlp.router.bias"):
        return "moe.router" + ("_bias" if rest.endswith("bias") else ""), tensor
    if rest == "mlp.experts.gate_up_proj":
        return "moe.gate_up", _gate_then_up(tensor.transpose(1, 2))  # stored [experts, hidden, 2 x width]
    if rest == "mlp.experts.gate_up_proj_bias":
        return "moe.gate_up_bias", _gate_then_up(tensor)
    if rest == "mlp.experts.down_proj":
        return "moe.down", tensor.transpose(1, 2).contiguous()
    if rest == "mlp.experts.down_proj_bias":
        return "moe.down_bias", tensor
    return None


_MXFP4 = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")


def _gpt_oss_mxfp4(layer: str, which: str, parts: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """gpt-oss's MXFP4 experts as MoE's float ones (models/mxfp4.py): gate_up's rows interleave gate
    and up, as its float form's columns do."""
    dense = dequantize_mxfp4(parts["blocks"], parts["scales"])  # [experts, rows, columns]
    if which == "down_proj":
        return f"layers.{layer}.moe.down", dense
    return f"layers.{layer}.moe.gate_up", _gate_then_up(dense)


def native_state_dict(weights: dict[str, torch.Tensor], family: str = "llama") -> dict[str, torch.Tensor]:
    """Maps HF Llama-family names onto LlamaDecoder's, fusing q/k/v and gate/up. Gemma's RMSNorms
    scale by (1 + weight): their weights get the 1 added here, in float32, so one norm serves all."""
    state: dict[str, torch.Tensor] = {}
    direct = {**_DIRECT, **_GEMMA_NORMS} if family.startswith("gemma") else {**_DIRECT, **_MOE_DIRECT}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # layer -> gate/up/down -> expert -> tensor
    mxfp4: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (layer, gate_up_proj | down_proj) -> blocks, scales
    fused: dict[str, dict[int, torch.Tensor]] = {}
    bare = not any(name.startswith("model.") for name in weights)  # a `*Model` checkpoint: no prefix
    for name, tensor in weights.items():
        if bare and name != "lm_head.weight":
            name = "model." + name
        if name == "model.embed_tokens.weight":
            state["embed.weight"] = tensor
        elif name == "model.norm.weight":
            state["norm"] = tensor
        elif name == "lm_head.weight":
            state["lm_head.weight"] = tensor
        elif m := _LAYER.match(name):
            layer, rest = m[1], m[2]
            if family == "gpt_oss" and (mapped := _gpt_oss(rest, tensor)) is not None:
                state[f"layers.{layer}.{mapped[0]}"] = mapped[1]
                continue
            if family == "gpt_oss" and (packed := _MXFP4.match(rest)):
                mxfp4.setdefault((layer, packed[1]), {})[packed[2]] = tensor
                continue
            if rest in direct:
                state[f"layers.{layer}.{direct[rest]}"] = tensor
                continue
            if e := _EXPERT.match(rest):
                experts.setdefault(layer, {}).setdefault(_EXPERT_PART[e[2]], {})[int(e[1])] = tensor
                continue
            module, _, kind = rest.rpartition(".")
            if module in _FUSED:
                target, pos = _FUSED[module]
                fused.setdefault(f"layers.{layer}.{target}.{kind}", {})[pos] = tensor
    for name, parts in fused.items():
        state[name] = torch.cat([parts[i] for i in sorted(parts)])
    for (layer, which), packed in mxfp4.items():
        if len(packed) == 2:  # NOTE: else left out, so the model's strict load names what is missing
            name, tensor = _gpt_oss_mxfp4(layer, which, packed)
            state[name] = tensor
    for layer, parts in experts.items():
        count = 1 + max(max(p) for p in parts.values())
        if any(len(parts.get(k, {})) != count for k in ("gate", "up", "down")):
            continue  # NOTE: left out, so the model's strict load names what is missing
        gate, up, down = ([parts[k][e] for e in range(count)] for k in ("gate", "up", "down"))
        state[f"layers.{layer}.moe.gate_up"] = torch.stack([torch.cat(pair) for pair in zip(gate, up, strict=True)])
        state[f"layers.{layer}.moe.down"] = torch.stack(down)
    if family.startswith("gemma"):
        for name, tensor in state.items():
            if name == "norm" or name.endswith("_norm"):
                state[name] = (tensor.float() + 1.0).to(tensor.dtype)
    return state


def gguf_state_dict(info: DecoderInfo, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A GGUF's tensors dequantized one at a time straight to `device` and `dtype`, q/k/v and gate/up
    fused as soon as a layer's parts are in: at most one layer's parts are held twice."""
    config = info.config
    family = ARCHITECTURES[config.architecture]
    state: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor, position in open_gguf(info.path).native_tensors(family, config.num_heads, config.num_kv_heads):
        tensor = tensor.to(device=device, dtype=dtype)
        if position is None:
            state[name] = tensor
            continue
        parts = fused.setdefault(name, {})
        parts[position] = tensor
        if len(parts) == (3 if ".qkv." in name else 2):
            # NOTE: experts' gate and up (and their biases) are stacked [experts, rows, ...]: joined along the rows
            rows = 1 if name.endswith((".moe.gate_up", ".moe.gate_up_bias")) else 0
            state[name] = torch.cat([parts[i] for i in sorted(parts)], dim=rows)
            del fused[name]
    if fused:
        raise ModelError(f"GGUF lacks parts of {sorted(fused)[:2]}", path=str(info.path))
    return state


def assign_weights(model: Any, state: dict[str, torch.Tensor], path: Path) -> Any:
    """A decoder built on the meta device given its weights (strict: a missing tensor or a shape the
    config does not give is a ModelError), its RoPE tables built; in eval mode, without gradients."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelError(f"weights are missing {missing[:4]}", path=str(path))
    wrong = [
        f"{k} {tuple(state[k].shape)} (config gives {tuple(v.shape)})"
        for k, v in expected.items()
        if state[k].shape != v.shape
    ]
    if wrong:
        raise ModelError(f"weights do not match the config: {', '.join(wrong[:2])}", path=str(path))
    model.load_state_dict(state, strict=False, assign=True)
    model.build_rope()
    return model.eval().requires_grad_(False)


QUANTIZE = ("none", "fp8", "int8")


def load_decoder(
    info: DecoderInfo,
    device: torch.device,
    dtype: torch.dtype,
    quantize: str = "none",
    int8_kernel: str = "auto",
) -> LlamaDecoder:
    """Builds the decoder on `device` in `dtype`, its linear layers' weights in FP8 with
    `quantize="fp8"` (models/fp8.py) or int8 with `"int8"` (CPU, models/int8.py, checked whole by
    models/decoder_int8.py: the kernel `int8_kernel` names or the fastest accurate one); strict about
    missing tensors."""
    if quantize == "int8":
        if (problem := int8_problem(device, dtype)) is not None:
            raise ConfigError(problem)
        ids = torch.tensor(load_tokenizer(info).encode(PROBE_TEXT).ids[:256], dtype=torch.long)
        return int8_checked(lambda: load_decoder(info, device, dtype), int8_kernel, ids)
    if quantize not in QUANTIZE:
        raise ConfigError(f"--quantize must be one of {', '.join(QUANTIZE)} for a causal LM (got {quantize!r})")
    if info.gguf:
        state = gguf_state_dict(info, device, dtype)
    else:
        weights: dict[str, torch.Tensor] = {}
        for file in weight_files(info.path):
            try:
                weights.update(load_file(str(file)))
            except Exception as exc:  # safetensors raises its own error types
                raise ModelError(f"cannot load weights ({exc})", path=str(file)) from None
        if info.vision is not None:  # NOTE: a vision-language model: its text model's weights (models/vlm.py)
            weights = text_weights(weights)
        family = ARCHITECTURES[info.config.architecture]
        state = {k: v.to(device=device, dtype=dtype) for k, v in native_state_dict(weights, family).items()}
    with empty_modules():
        model = LlamaDecoder(info.config)
    if info.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state and "embed.weight" in state:
        state["lm_head.weight"] = state["embed.weight"]  # some checkpoints omit a head equal to the embedding
    model = assign_weights(model, state, info.path)
    if MoE.column_major_pays(device, dtype):
        for layer in model.layers:
            if layer.moe is not None:
                layer.moe.column_major()  # NOTE: the CPU's expert-by-expert loop runs faster on them
    return quantize_decoder_fp8(model, device) if quantize == "fp8" else model


__all__ = [
    "QUANTIZE",
    "assign_weights",
    "gguf_state_dict",
    "load_decoder",
    "load_tokenizer",
    "native_state_dict",
]
