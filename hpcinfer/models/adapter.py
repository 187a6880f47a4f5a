"""The model adapter protocol every model sits behind, and the sentence-embedding adapter.

The executor only knows `BatchModel`: it hands over device tensors (ids [rows, padded_len] and
lengths [rows]) and gets back one float32 vector per row. Later adapters (a generic
`transformers` one, decoder models) implement the same three steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from .batch_model import BatchSteps
from .bert import BertEncoder, can_pack_for_cpu, pack_for_cpu
from .checkpoint import PoolingSpec, load_encoder


class BatchModel(Protocol):
    output_dim: int

    def prepare(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object: ...

    def postprocess(self, outputs: object) -> torch.Tensor: ...

    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> torch.Tensor: ...


def pool(hidden: torch.Tensor, token_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [b, n, h] + token_mask [b, n] -> [b, h] float32 (modes: checkpoint.POOLING_MODES)."""
    hidden = hidden.float()
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":  # the last real token of each row (padding is on the right)
        last = token_mask.sum(dim=1).clamp_min(1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    mask = token_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(~token_mask.unsqueeze(-1), float("-inf")).amax(dim=1)
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp_min(1e-9)
    if mode == "mean":
        return summed / counts
    if mode == "mean_sqrt_len":
        return summed / counts.sqrt()
    raise ValueError(f"unknown pooling mode {mode!r}")


def embed_vectors(hidden: torch.Tensor, token_mask: torch.Tensor, pooling: PoolingSpec) -> torch.Tensor:
    """Token states -> the row's embedding: pooled, Matryoshka-truncated, L2-normalised as `pooling` says."""
    pooled = pool(hidden, token_mask, pooling.mode)
    if pooling.dimensions:  # NOTE: Matryoshka: truncate first, then normalise what is kept
        pooled = pooled[:, : pooling.dimensions]
    return F.normalize(pooled, p=2, dim=1) if pooling.normalize else pooled


@dataclass(frozen=True, slots=True)
class PoolingHead:
    """heads.Head: a BERT-family encoder's token states pooled as `info.pooling` says."""

    ragged = None

    def width(self, info: Any) -> int:
        return info.pooling.dimensions or info.config.hidden_size

    def load(self, info: Any, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool) -> SentenceEmbedder:
        encoder = load_encoder(info).to(device=device, dtype=dtype)
        if cpu_fast_path and can_pack_for_cpu(encoder):
            encoder = pack_for_cpu(encoder)
        return SentenceEmbedder(encoder, info.pooling, dtype)


class SentenceEmbedder(BatchSteps):
    """Encoder + pooling + optional L2 normalisation, as the sentence-transformers config says."""

    def __init__(self, encoder: BertEncoder, pooling: PoolingSpec, dtype: torch.dtype) -> None:
        self.encoder = encoder
        self.pooling = pooling
        self.dtype = dtype
        self.output_dim = pooling.dimensions or encoder.cfg.hidden_size

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        return self.encoder(ids, lengths, padded)

    def postprocess(self, outputs: object) -> torch.Tensor:
        hidden, token_mask = outputs  # type: ignore[misc]
        return embed_vectors(hidden, token_mask, self.pooling)
