"""A `*ForTokenClassification` checkpoint's facts: its encoder (as its family's sequence classifiers
have it), its labels, the longest row the run packs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...errors import ModelError
from ...models.checkpoint import CheckpointInfo, model_dir_config, sentence_transformers_info
from ...models.classifier import FAMILIES, classifier_config
from .model import TokenHead


def token_architecture(family: str) -> str:
    return FAMILIES[family].replace("ForSequenceClassification", "ForTokenClassification")


def inspect_token_classifier(path: Path, max_length: int | None) -> CheckpointInfo:
    """BERT, RoBERTa / XLM-R and DistilBERT token classifiers; `max_length`: --max-length, if given."""
    raw = model_dir_config(path)
    if not isinstance(raw, dict):
        raise ModelError("config.json is not an object", path=str(path))
    family, arch = str(raw.get("model_type")), next(iter(raw.get("architectures") or []), None)
    if family not in FAMILIES or arch != token_architecture(family):
        supported = ", ".join(token_architecture(f) for f in FAMILIES)
        raise ModelError(f"not a token classifier we run: {arch!r} (supported: {supported})", path=str(path))
    # NOTE: the encoder and labels read as for the family's sequence classifier: same config, same names
    config, spec = classifier_config({**raw, "architectures": [FAMILIES[family]]}, path)
    info = sentence_transformers_info(path, config, "cls")
    longest = min(info.max_seq_length, config.max_position_embeddings - config.position_offset)
    head = TokenHead(spec.labels, spec.family, max_length or longest)
    return replace(info, max_seq_length=longest, head=head)
