"""A `*ForTokenClassification` checkpoint as the encoder pipeline runs it: the BERT-family encoder,
then a linear layer over every token's state.

The pipeline moves one fixed-width float32 vector per row, so a row's tokens travel packed:
`width` = 3 x the longest row, each token as (label index, its probability, token id), and -1 in
all three past the row's end. The store unpacks them (store.py). Float32 holds every label index
and every token id below 2**24 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ModelError
from ...models.batch_model import BatchSteps
from ...models.bert import BertEncoder, can_pack_for_cpu, pack_for_cpu
from ...models.checkpoint import CheckpointInfo, encoder_from_weights, load_weights, weights_file
from ...models.classifier import ClassifierSpec, split_weights

FIELDS = 3  # label index, probability, token id


@dataclass(frozen=True, slots=True)
class TokenHead:
    """What the checkpoint's head is (CheckpointInfo.head): its labels and the longest row it packs."""

    labels: tuple[str, ...]
    family: str  # bert | roberta | distilbert: how its encoder's weights are named
    max_length: int

    @property
    def width(self) -> int:
        return FIELDS * self.max_length

    def load(
        self, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool
    ) -> TokenLabeller:
        encoder, linear = load_token_classifier(info, self)
        encoder = encoder.to(device=device, dtype=dtype)
        if cpu_fast_path and can_pack_for_cpu(encoder):
            encoder = pack_for_cpu(encoder)
        return TokenLabeller(encoder, linear.to(device=device, dtype=dtype), self.max_length)


def load_token_classifier(info: CheckpointInfo, head: TokenHead) -> tuple[BertEncoder, nn.Linear]:
    """The encoder and the `classifier` linear layer (float32, CPU); strict about missing tensors."""
    file = weights_file(info.path)
    if file is None:
        raise ModelError("no model.safetensors or pytorch_model.bin", path=str(info.path))
    weights = load_weights(file)
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
    """Encoder + linear head; a `BatchModel` whose row vector is its tokens packed (see the module)."""

    def __init__(self, encoder: BertEncoder, linear: nn.Linear, max_length: int) -> None:
        self.encoder, self.linear, self.max_length = encoder, linear, max_length
        self.output_dim = FIELDS * max_length

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        hidden, token_mask = self.encoder(ids, lengths, padded)
        return self.linear(hidden), token_mask, ids

    def postprocess(self, outputs: object) -> torch.Tensor:
        logits, token_mask, ids = outputs  # type: ignore[misc]
        score, label = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        n = min(ids.shape[1], self.max_length)
        packed = torch.stack((label.float(), score, ids.float()), dim=-1)[:, :n]  # [rows, n, 3]
        packed = packed.masked_fill(~token_mask[:, :n, None], -1.0)
        out = torch.full((ids.shape[0], self.max_length, FIELDS), -1.0, device=ids.device)
        out[:, :n] = packed
        return out.reshape(ids.shape[0], self.output_dim)
