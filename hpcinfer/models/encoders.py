"""The native encoders, by config.json's `model_type`: an architecture is a module under models/
(its config, its `nn.Module`, its weight names) and a line in `ARCHITECTURES`.

Every encoder module takes ids [rows, padded_len], lengths [rows], `padded` and optional token
types, and gives (hidden states [rows, len, hidden], token mask [rows, len]); keeps its blocks in
`layers` (int8 finds their linears there); has `cfg` with at least `vocab_size`, `hidden_size`,
`max_position_embeddings`, `position_offset` and `type_vocab_size`; and puts its linears on
prepacked oneDNN weights in `pack_for_cpu`. So every task on the encoder pipeline (embed, token
embeddings, classify, score, NER) runs each architecture, with int8 and the CPU fast path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ModelError, UnsupportedModel
from .bert_family import BERT, DISTILBERT, MPNET, ROBERTA
from .meta import empty_modules
from .modernbert import ModernBertEncoder, modernbert_config, rename_modernbert
from .nomic_bert import NomicBertEncoder, nomic_bert_config, rename_nomic_bert


class Architecture(Protocol):
    def config(self, raw: dict[str, Any]) -> Any:
        """The encoder's config from config.json; KeyError / TypeError where a field is missing,
        UnsupportedModel where it asks for what the native module does not do."""

    def build(self, config: Any) -> nn.Module:
        """The encoder module (its parameters as `empty_modules` leaves them: loaded next)."""

    def rename(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under the module's names (the rest dropped)."""


@dataclass(frozen=True, slots=True)
class Parts:
    """An Architecture from its module's three functions."""

    config: Callable[[dict[str, Any]], Any]
    build: Callable[[Any], nn.Module]
    rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


ARCHITECTURES: dict[str, Architecture] = {
    "bert": BERT,
    "roberta": ROBERTA,
    "xlm-roberta": ROBERTA,
    "camembert": ROBERTA,
    "distilbert": DISTILBERT,
    "mpnet": MPNET,
    "modernbert": Parts(modernbert_config, ModernBertEncoder, rename_modernbert),
    "nomic_bert": Parts(nomic_bert_config, NomicBertEncoder, rename_nomic_bert),
}
ENCODER_TYPES = tuple(ARCHITECTURES)


def encoder_config(raw: Any, path: Path) -> Any:
    """The native encoder's config for a config.json (UnsupportedModel for a model_type with none)."""
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    architecture = ARCHITECTURES.get(str(kind))
    if architecture is None:
        raise UnsupportedModel(
            f"no native encoder for model_type {kind!r} (native: {', '.join(ENCODER_TYPES)}; "
            "any other on --backend transformers)",
            path=str(path),
        )
    try:
        return architecture.config(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"incomplete config.json ({exc!r})", path=str(path)) from None
    except UnsupportedModel as exc:
        raise UnsupportedModel(str(exc), path=str(path)) from None


def encoder_from_weights(config: Any, weights: dict[str, torch.Tensor], file: Path) -> nn.Module:
    """The encoder `config` names, its weights loaded (float32, CPU); strict about missing tensors."""
    architecture = ARCHITECTURES[config.model_type]
    with empty_modules():
        encoder = architecture.build(config)
    state = {k: v.float() for k, v in architecture.rename(weights).items()}
    expected = encoder.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelError(f"weights are missing {missing[:4]}", path=str(file))
    wrong = [f"{k} {tuple(state[k].shape)} (the config says {tuple(v.shape)})" for k, v in expected.items()
             if state[k].shape != v.shape]  # fmt: skip
    if wrong:
        raise ModelError(f"weights do not fit config.json: {', '.join(wrong[:2])}", path=str(file))
    encoder.load_state_dict(state, strict=False, assign=True)
    return encoder.eval().requires_grad_(False)


__all__ = ["ARCHITECTURES", "ENCODER_TYPES", "Architecture", "Parts", "encoder_config", "encoder_from_weights"]
