"""Read a causal-LM checkpoint without its weights: a HF directory's config, EOS ids, chat template and
special tokens, or a GGUF file's metadata (`DecoderInfo`); `is_causal_lm` tells one from an encoder.

NOTE: as for encoders, nothing in a model directory is imported or executed: JSON is parsed as data,
and a chat template is rendered later in a sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ModelError
from .checkpoint import CheckpointInfo, read_model_json, sentence_transformers_info
from .decoder_config import ARCHITECTURES, DecoderConfig
from .gguf_checkpoint import GGUFFile, find_gguf
from .vlm import VLM_ARCHITECTURES, is_vlm, text_config, vision_info


@dataclass(frozen=True, slots=True)
class DecoderInfo:
    path: Path
    config: DecoderConfig
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... for templates
    gguf: bool = False  # `path` is a GGUF file, not a HF directory
    vision: Any = None  # a vision-language model's models.vlm.VisionInfo (its config is its text model's)

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
    return any(str(a).endswith(("ForCausalLM", "LMHeadModel")) or str(a) in VLM_ARCHITECTURES for a in archs or [])


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
    vision = None
    if native and is_vlm(raw):  # NOTE: the engine runs its text model; the vision tower is models/vlm.py's
        try:
            vision = vision_info(raw)
            outer_eos = raw.get("eos_token_id")
            raw = text_config(raw)
            raw["eos_token_id"] = outer_eos if outer_eos is not None else raw.get("eos_token_id")
        except ModelError as exc:
            raise type(exc)(str(exc), path=str(path)) from None
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
    return DecoderInfo(path, config, tuple(eos), template, special, vision=vision)


def _config(raw: dict[str, Any], path: Path) -> DecoderConfig:
    try:
        return DecoderConfig.from_hf(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"incomplete config ({exc})", path=str(path)) from None
    except ModelError as exc:
        raise type(exc)(str(exc), path=str(path)) from None  # NOTE: an UnsupportedModel stays one


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


def weight_files(path: Path) -> list[Path]:
    """model.safetensors, or every shard a model.safetensors.index.json names."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_model_json(index).get("weight_map", {}).values()))
        return [path / s for s in shards]
    return []


__all__ = [
    "DecoderInfo",
    "inspect_decoder",
    "inspect_decoder_embedder",
    "inspect_gguf",
    "is_causal_lm",
    "loose_config",
    "open_gguf",
    "weight_files",
]
