"""Load a Hugging Face causal-LM checkpoint: config, (sharded) safetensors weights, tokenizer config.

NOTE: as for encoders, nothing in a model directory is imported or executed: weights load through
safetensors only, JSON is parsed as data, and a chat template is rendered later in a sandbox.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ..errors import ConfigError, ModelError
from .checkpoint import CheckpointInfo, read_model_json, sentence_transformers_info
from .fp8 import quantize_decoder_fp8
from .gguf_checkpoint import GGUFFile, find_gguf
from .gguf_tokenizer import gguf_tokenizer
from .int8 import (
    candidate_kernels,
    int8_problem,
    missing_int8_instructions,
    no_accurate_kernel,
    pick_kernel,
    quantize_decoder_int8,
)
from .llama import ARCHITECTURES, DecoderConfig, DenseCausalAttention, LlamaDecoder
from .meta import empty_modules


@dataclass(frozen=True, slots=True)
class DecoderInfo:
    path: Path
    config: DecoderConfig
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... for templates
    gguf: bool = False  # `path` is a GGUF file, not a HF directory

    @property
    def weight_files(self) -> list[Path]:
        return [self.path] if self.gguf else weight_files(self.path)


def is_causal_lm(path: Path) -> bool:
    """True for a GGUF file and when config.json names a `*ForCausalLM` (or `*LMHeadModel`, as GPT-2
    does) architecture, supported or not."""
    if find_gguf(path) is not None:
        return True
    file = path / "config.json"
    if not file.is_file():
        return False
    raw = read_model_json(file)
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    return any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs or [])


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def inspect_decoder(path: Path, native: bool = True) -> DecoderInfo:
    """Validates a causal-LM checkpoint (a HF directory or a GGUF file) and reads everything but the weights.

    `native=False` (--backend transformers): any architecture; transformers reads the weights,
    and the config gives only what the job itself needs (`loose_config`)."""
    if (file := find_gguf(path)) is not None:
        return inspect_gguf(file)
    if not path.is_dir():
        raise ModelError("model directory not found", path=str(path))
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelError(f"model directory has no {name}", path=str(path))
    if native and not weight_files(path):
        raise ModelError("model directory has no model.safetensors (nor model.safetensors.index.json)", path=str(path))
    raw = read_model_json(path / "config.json")
    config = _config(raw, path) if native else loose_config(raw, path)
    eos = _ids(raw.get("eos_token_id"))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos += [i for i in _ids(read_model_json(gen_file).get("eos_token_id")) if i not in eos]
    tok_cfg = read_model_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    special = {
        key: text
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (text := _token_text(tok_cfg.get(key))) is not None
    }
    return DecoderInfo(path, config, tuple(eos), template, special)


def _config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    try:
        return DecoderConfig.from_hf(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"incomplete config ({exc})", path=str(path)) from None
    except ModelError as exc:
        raise ModelError(str(exc), path=str(path)) from None


def loose_config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    """The native reading where it works; for another architecture, the few facts the generation
    job uses (the vocabulary, the context) under the names transformers' configs use for them."""
    try:
        return DecoderConfig.from_hf(raw)
    except (KeyError, TypeError, ValueError, ModelError):
        pass

    def first(*keys: str, default: Any = None) -> Any:
        return next((raw[k] for k in keys if raw.get(k) is not None), default)

    vocab = first("vocab_size", default=(raw.get("text_config") or {}).get("vocab_size"))
    if vocab is None:
        raise ModelError("config.json gives no vocab_size", path=str(path))
    hidden = int(first("hidden_size", "n_embd", "d_model", default=1))
    heads = int(first("num_attention_heads", "n_head", "num_heads", default=1))
    context = int(first("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", default=2048))
    arch = next(iter(raw.get("architectures") or []), raw.get("model_type", "unknown"))
    return DecoderConfig(
        architecture=str(arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(first("intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden),
        num_layers=int(first("num_hidden_layers", "n_layer", "num_layers", default=1)),
        num_heads=heads,
        num_kv_heads=int(first("num_key_value_heads", default=heads)),
        head_dim=max(1, hidden // max(1, heads)),
        rms_norm_eps=1e-6,
        max_position_embeddings=context,
    )


def inspect_decoder_embedder(path: Path) -> CheckpointInfo:
    """A Llama-family checkpoint read as an embedder (Qwen3-Embedding, gte-Qwen2, e5-mistral): its
    decoder (a `*ForCausalLM` or a bare `*Model`), and its sentence-transformers files; pooling
    `last` where they name none."""
    raw = read_model_json(path / "config.json")
    assert isinstance(raw, dict)
    arch = str(next(iter(raw.get("architectures") or []), ""))
    if arch.endswith("Model") and arch.removesuffix("Model") + "ForCausalLM" in ARCHITECTURES:
        raw = {**raw, "architectures": [arch.removesuffix("Model") + "ForCausalLM"]}  # the same layers, no head
    config = _config(raw, path)
    if not weight_files(path):
        raise ModelError("model directory has no model.safetensors (nor an index of shards)", path=str(path))
    decoder = DecoderInfo(path, config, ())
    return sentence_transformers_info(path, config, "last", decoder)


def inspect_gguf(file: Path) -> DecoderInfo:
    """A GGUF file's config, EOS ids, chat template and special tokens, from its metadata."""
    gguf = open_gguf(file)
    template = gguf.value("tokenizer.chat_template")
    return DecoderInfo(
        file, _config(gguf.hf_config(), file), gguf.eos_token_ids(), template, gguf.special_tokens(), gguf=True
    )


@lru_cache(maxsize=2)
def open_gguf(file: Path) -> GGUFFile:
    """Parsing a GGUF's metadata takes seconds (every vocabulary entry is a field): once per process."""
    return GGUFFile(file)


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


def weight_files(path: Path) -> list[Path]:
    """model.safetensors, or every shard a model.safetensors.index.json names."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_model_json(index).get("weight_map", {}).values()))
        return [path / s for s in shards]
    return []


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DIRECT = {
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.o_proj.bias": "o_proj.bias",
    "mlp.down_proj.weight": "down.weight",
    "mlp.down_proj.bias": "down.bias",
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
_FUSED = {  # HF name -> (native fused name, position in the concatenation)
    "self_attn.q_proj": ("qkv", 0),
    "self_attn.k_proj": ("qkv", 1),
    "self_attn.v_proj": ("qkv", 2),
    "mlp.gate_proj": ("gate_up", 0),
    "mlp.up_proj": ("gate_up", 1),
}


def native_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps HF Llama-family names onto LlamaDecoder's, fusing q/k/v and gate/up."""
    state: dict[str, torch.Tensor] = {}
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
            if rest in _DIRECT:
                state[f"layers.{layer}.{_DIRECT[rest]}"] = tensor
                continue
            module, _, kind = rest.rpartition(".")
            if module in _FUSED:
                target, pos = _FUSED[module]
                fused.setdefault(f"layers.{layer}.{target}.{kind}", {})[pos] = tensor
    for name, parts in fused.items():
        state[name] = torch.cat([parts[i] for i in sorted(parts)])
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
            state[name] = torch.cat([parts[i] for i in sorted(parts)])
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
INT8_ROWS = 64  # a batched decode step's rows, for timing int8 kernel libraries (models/int8.py)


# int8 for a causal LM: the share of a reference text's next tokens whose argmax int8 keeps (int8_checked).
# NOTE: measured on SmolLM2-135M over PROBE_TEXT: 8-bit activations with 32-bit sums 0.70, 7-bit activations
# 0.49, a kernel saturating 16-bit sums 0.00; the floor sits between the first two.
TOKEN_AGREEMENT_FLOOR = 0.6
PROBE_TEXT = (
    "In 1969 two astronauts walked on the Moon while a third waited in orbit. Today scientists use telescopes "
    "in space to study distant galaxies, and engineers build rockets that land on their own. Photosynthesis "
    "lets plants turn sunlight, water and carbon dioxide into sugar and oxygen. The heart pumps blood through "
    "the body, and the lungs bring in the oxygen it carries. The capital of France is Paris. Water boils at "
    "one hundred degrees Celsius at sea level, and the Earth goes around the Sun once a year."
)


def load_decoder(
    info: DecoderInfo,
    device: torch.device,
    dtype: torch.dtype,
    quantize: str = "none",
    int8_kernel: str = "auto",
) -> LlamaDecoder:
    """Builds the decoder on `device` in `dtype`, its linear layers' weights in FP8 with
    `quantize="fp8"` (models/fp8.py) or int8 with `"int8"` (CPU, models/int8.py, the kernel
    `int8_kernel` names or the fastest accurate one); strict about missing tensors."""
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
        state = {k: v.to(device=device, dtype=dtype) for k, v in native_state_dict(weights).items()}
    with empty_modules():
        model = LlamaDecoder(info.config)
    if info.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state and "embed.weight" in state:
        state["lm_head.weight"] = state["embed.weight"]  # some checkpoints omit a head equal to the embedding
    model = assign_weights(model, state, info.path)
    return quantize_decoder_fp8(model, device) if quantize == "fp8" else model


def next_tokens(model: LlamaDecoder, ids: torch.Tensor) -> torch.Tensor:
    """The model's greedy next token after each prefix of `ids`."""
    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(len(ids)), DenseCausalAttention())).argmax(-1)


def int8_checked(build_float: Callable[[], LlamaDecoder], kernel_name: str, ids: torch.Tensor) -> LlamaDecoder:
    """The decoder in int8 on the first candidate kernel (fastest first) that keeps at least
    TOKEN_AGREEMENT_FLOOR of float32's greedy next tokens over `ids` (PROBE_TEXT); none: refused
    in one line.

    NOTE: the kernels have passed the layer-level accuracy probe (models/int8.probe_kernels);
    this checks the whole model, where a layer's error compounds through the depth."""
    model = build_float()
    vocab = model.embed.weight.shape[0]
    ids = ids.clamp(max=vocab - 1) if len(ids) >= 16 else (torch.arange(1, 65) * 7919) % vocab
    reference = next_tokens(model, ids)
    kernels = candidate_kernels(kernel_name)
    if not kernels:
        raise ConfigError(f"--quantize int8: {no_accurate_kernel()}")
    first = pick_kernel(model.layers[0].gate_up.weight.detach(), INT8_ROWS, kernels) if len(kernels) > 1 else kernels[0]
    found: list[str] = []
    for i, kernel in enumerate([first] + [k for k in kernels if k != first]):
        if i:
            model = build_float()
        quantize_decoder_int8(model, INT8_ROWS, kernel)
        agreement = float((next_tokens(model, ids) == reference).float().mean())
        if agreement >= TOKEN_AGREEMENT_FLOOR:
            return model
        found.append(f"{kernel.name} {agreement:.0%}")
    missing = missing_int8_instructions()
    raise ConfigError(
        f"--quantize int8 refused: int8 keeps under {TOKEN_AGREEMENT_FLOOR:.0%} of float32's next tokens on a "
        f"reference text ({', '.join(found)}){'; ' + missing if missing else ''}"
    )


__all__ = [
    "ARCHITECTURES",
    "DecoderInfo",
    "inspect_decoder",
    "inspect_decoder_embedder",
    "is_causal_lm",
    "load_decoder",
    "load_tokenizer",
]
