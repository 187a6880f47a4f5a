"""`--backend transformers`: any checkpoint `transformers` loads, inside hpcinfer's own pipeline.

The pooling tasks (embed, classify, score) take `transformers`' `AutoModel` or
`AutoModelForSequenceClassification` as their `BatchModel`: reading, sorting, token-budget
batches, staging, timing, rejects, resume, several devices and Ray stay hpcinfer's; only the
forward is transformers'. The native path stays the default where it exists (it is faster: fused
QKV, prepacked CPU linears, no per-call module overhead), and the backend is there for the
architectures it does not have.

NOTE: `trust_remote_code` is never set: a checkpoint's own Python is not run, as on the native path.
Generation on this backend is `engine/hf_engine.py`: static batches of transformers'
`AutoModelForCausalLM` (no paged KV cache, continuous batching or prefix caching).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError
from .adapter import embed_vectors
from .checkpoint import CheckpointInfo, PoolingSpec, read_model_json, sentence_transformers_info
from .classifier import head_spec, label_probabilities, pair_separator, pair_token_types
from .hf_load import quiet_from_pretrained

DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2", "gpt_neox")


@dataclass(frozen=True, slots=True)
class HFConfig:
    """What the pipeline reads of any checkpoint's config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int


def inspect_hf(path: Path, task: str) -> CheckpointInfo:
    """Any `transformers` checkpoint as a pooling task's: its sentence-transformers files where it has
    them; for classify / score its labels (score: one, with CrossEncoder's activation)."""
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        raise ModelError("--backend transformers needs config.json and tokenizer.json", path=str(path))
    raw = read_model_json(path / "config.json")
    if not isinstance(raw, dict):
        raise ModelError("config.json is not an object", path=str(path))
    kind = str(raw.get("model_type", ""))
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    hidden = text.get("hidden_size") or text.get("dim") or text.get("d_model") or text.get("n_embd")
    positions = text.get("max_position_embeddings") or text.get("n_positions") or 512
    if not hidden or "vocab_size" not in text:
        raise ModelError("config.json names no hidden size or vocabulary", path=str(path))
    config = HFConfig(kind, int(text["vocab_size"]), int(hidden), int(positions))
    decoder = kind in DECODER_TYPES
    info = replace(sentence_transformers_info(path, config, "last" if decoder else "mean"), head=TransformersHead())
    if task not in ("classify", "score"):
        return info
    arch = str(next(iter(raw.get("architectures") or []), ""))
    if not arch.endswith("ForSequenceClassification"):
        raise ModelError(f"--task {task} needs a *ForSequenceClassification checkpoint, not {arch!r}", path=str(path))
    spec = head_spec(raw, kind, path, task == "score")
    if spec.score and int(text.get("type_vocab_size") or 0) > 1:
        spec = replace(spec, sep_id=pair_separator(path))
    return replace(info, classifier=spec)


@dataclass(frozen=True, slots=True)
class TransformersHead:
    """heads.Head: `--backend transformers`: the pooling or the classifier head on transformers' own model."""

    ragged = None

    def width(self, info: CheckpointInfo) -> int:
        if info.classifier is not None:
            return len(info.classifier.labels)
        return info.pooling.dimensions or info.config.hidden_size

    def load(self, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool) -> HFModel:
        return load_hf(info, device, dtype)


class HFModel:
    """A `transformers` model as a `BatchModel`: right-padded ids with their attention mask in,
    the pooled embedding or the label probabilities out."""

    def __init__(self, model: Any, info: CheckpointInfo, dtype: torch.dtype) -> None:
        self.model, self.info, self.dtype = model, info, dtype
        self.output_dim = info.output_dim
        self.pooling: PoolingSpec = info.pooling

    def prepare(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ids, lengths

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        inputs: dict[str, torch.Tensor] = {"input_ids": ids.long(), "attention_mask": mask.long()}
        spec = self.info.classifier
        if spec is not None and spec.sep_id is not None:  # a pair's second segment
            inputs["token_type_ids"] = pair_token_types(ids, spec.sep_id)
        out = self.model(**inputs)
        return (out.logits,) if self.info.classifier is not None else (out.last_hidden_state, mask)

    def postprocess(self, outputs: object) -> torch.Tensor:
        if self.info.classifier is not None:
            return label_probabilities(outputs[0], self.info.classifier)  # type: ignore[index]
        hidden, mask = outputs  # type: ignore[misc]
        return embed_vectors(hidden, mask, self.pooling)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool = True) -> torch.Tensor:
        return self.postprocess(self.forward(ids, lengths, padded))


def load_hf(info: CheckpointInfo, device: torch.device, dtype: torch.dtype) -> HFModel:
    """The checkpoint through `transformers` (a test dependency: installed where this backend runs)."""
    try:
        import transformers
    except ImportError:
        raise ModelError("--backend transformers needs the transformers package (pip install transformers)") from None
    cls = transformers.AutoModelForSequenceClassification if info.classifier is not None else transformers.AutoModel
    try:
        model = quiet_from_pretrained(cls, info.path, dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"transformers cannot load it ({exc})", path=str(info.path)) from None
    return HFModel(model.to(device).eval().requires_grad_(False), info, dtype)


__all__ = ["HFModel", "TransformersHead", "inspect_hf", "load_hf"]
