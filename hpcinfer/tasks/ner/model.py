"""A `*ForTokenClassification` checkpoint as the encoder pipeline runs it: the BERT-family encoder,
then a linear layer over every token's state.

A row's values are ragged items (`values.Ragged`): one per real token, its `label` index, that
label's probability (`score`) and its `token` id; the store names them (store.py).

The checkpoint's facts (`inspect_token_classifier`): its encoder (as its family's sequence
classifiers have it), its labels, the longest row the run packs; they carry this head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ...errors import ModelError, UnsupportedModel
from ...models.batch_model import BatchSteps
from ...models.bert import BertEncoder, can_pack_for_cpu, pack_for_cpu
from ...models.checkpoint import (
    CheckpointInfo,
    encoder_from_weights,
    load_weights,
    model_dir_config,
    sentence_transformers_info,
    weights_file,
)
from ...models.classifier import FAMILIES, ClassificationHead, ClassifierSpec, classifier_config, split_weights
from ...values import Ragged, RaggedField, RaggedSpec

FIELDS = (RaggedField("label", "int32"), RaggedField("score", "float32"), RaggedField("token", "int32"))


@dataclass(frozen=True, slots=True)
class TokenHead:
    """What the checkpoint's head is (CheckpointInfo.head): its labels and the longest row."""

    labels: tuple[str, ...]
    family: str  # bert | roberta | distilbert: how its encoder's weights are named
    max_length: int
    spec: ClassifierSpec | None = None  # ModernBERT: its head's layers (dense, norm) before the classifier

    def width(self, info: CheckpointInfo) -> int:
        return 0  # no dense values: a row's are its tokens' labels (ragged)

    @property
    def ragged(self) -> RaggedSpec:
        return RaggedSpec(FIELDS, self.max_length)

    def load(
        self, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool
    ) -> TokenLabeller:
        encoder, linear = load_token_classifier(info, self)
        encoder = encoder.to(device=device, dtype=dtype)
        if cpu_fast_path and can_pack_for_cpu(encoder):
            encoder = pack_for_cpu(encoder)
        return TokenLabeller(encoder, linear.to(device=device, dtype=dtype), self.max_length)


def load_token_classifier(info: CheckpointInfo, head: TokenHead) -> tuple[BertEncoder, nn.Module]:
    """The encoder and the head over each token (float32, CPU): the `classifier` linear layer, or
    ModernBERT's dense + GELU + norm before it; strict about missing tensors."""
    file = weights_file(info.path)
    if file is None:
        raise ModelError("no model.safetensors or pytorch_model.bin", path=str(info.path))
    weights = load_weights(file)
    if head.spec is not None:  # NOTE: ModernBERT's head is its sequence classifier's, over every token
        encoder_weights, head_weights = split_weights(weights, head.spec)
        layers = ClassificationHead(head.spec, info.config.hidden_size)
        missing = set(layers.state_dict()) - set(head_weights)
        if missing:
            raise ModelError(f"the token classification head's weights ({', '.join(sorted(missing))}) are missing",
                             path=str(file))  # fmt: skip
        layers.load_state_dict({k: v.float() for k, v in head_weights.items()})
        return encoder_from_weights(info.config, encoder_weights, file), layers.eval().requires_grad_(False)
    found = {name: weights.pop(f"classifier.{name}", None) for name in ("weight", "bias")}
    if any(t is None for t in found.values()):
        raise ModelError(
            "the token classification head's weights (classifier.weight, .bias) are missing", path=str(file)
        )
    linear = nn.Linear(info.config.hidden_size, len(head.labels))
    linear.load_state_dict({k: v.float() for k, v in found.items()})  # type: ignore[union-attr]
    # NOTE: the encoder is named as in the family's sequence classifiers (RoBERTa's prefix, DistilBERT's names)
    encoder_weights, _ = split_weights(weights, ClassifierSpec(head.family, head.labels))
    return encoder_from_weights(info.config, encoder_weights, file), linear.eval().requires_grad_(False)


class TokenLabeller(BatchSteps):
    """Encoder + linear head; a `BatchModel` whose rows are their tokens' labels (ragged items)."""

    output_dim = 0

    def __init__(self, encoder: BertEncoder, linear: nn.Module, max_length: int) -> None:
        self.encoder, self.linear, self.max_length = encoder, linear, max_length

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        hidden, token_mask = self.encoder(ids, lengths, padded)
        return self.linear(hidden), token_mask, ids

    def postprocess(self, outputs: object) -> Ragged:
        logits, token_mask, ids = outputs  # type: ignore[misc]
        score, label = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        fields = {"label": label[token_mask].int(), "score": score[token_mask], "token": ids[token_mask].int()}
        return Ragged(token_mask.sum(dim=1), fields)


# The sequence classifiers' families whose token classifier runs natively: the encoder and one
# linear layer, or ModernBERT's dense + GELU + norm head before it (NomicBERT ships none of its own)
TOKEN_FAMILIES = tuple(f for f in FAMILIES if f != "nomic_bert")


def token_architecture(family: str) -> str:
    return FAMILIES[family].replace("ForSequenceClassification", "ForTokenClassification")


def inspect_token_classifier(path: Path, max_length: int | None) -> CheckpointInfo:
    """The native encoders' token classifiers (BERT, RoBERTa / XLM-R / CamemBERT, DistilBERT, MPNet,
    ModernBERT);
    `max_length`: --max-length, if given."""
    raw = model_dir_config(path)
    if not isinstance(raw, dict):
        raise ModelError("config.json is not an object", path=str(path))
    family, arch = str(raw.get("model_type")), next(iter(raw.get("architectures") or []), None)
    if family not in TOKEN_FAMILIES or arch != token_architecture(family):
        supported = ", ".join(token_architecture(f) for f in TOKEN_FAMILIES)
        raise UnsupportedModel(f"no native token classifier for {arch!r} (native: {supported})", path=str(path))
    # NOTE: the encoder and labels read as for the family's sequence classifier: same config, same names
    config, spec = classifier_config({**raw, "architectures": [FAMILIES[family]]}, path)
    info = sentence_transformers_info(path, config, "cls")
    longest = min(info.max_seq_length, config.max_position_embeddings - config.position_offset)
    head = TokenHead(spec.labels, spec.family, max_length or longest, spec if family == "modernbert" else None)
    return replace(info, max_seq_length=longest, head=head)
