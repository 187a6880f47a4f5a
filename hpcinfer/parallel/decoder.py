"""The Llama-family decoder on one rank of a tensor-parallel group (Megatron-style).

Each rank holds 1/N of every layer: the q/k/v and gate/up projections column-parallel (its own
heads and its own slice of the MLP, no communication), o_proj and down row-parallel (a partial
product, then one all-reduce each). The rank's layer is `models.llama.DecoderLayer` itself, built
from the rank's config (heads, KV heads and MLP width divided by N), so attention, RoPE and the
q/k norms run unchanged on its heads, and its KV cache holds only its KV heads.

The embedding and LM head are vocabulary-parallel by default: each rank holds vocab/N rows, the
embedding is one all-reduce of [T, hidden] (every token's row comes from one rank, zeros from the
others), the logits one gather of [S, vocab/N] to rank 0. `vocab_parallel=False` replicates
both instead (no collective, the whole vocabulary on every rank; only rank 0 computes logits).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..models.decoder_config import DecoderConfig
from ..models.llama import LlamaDecoder
from .group import Collectives


def rank_config(cfg: DecoderConfig, world: int) -> DecoderConfig:
    """One rank's share of `cfg`: heads, KV heads and MLP width divided by `world` (the vocabulary
    stays whole: the logits rank 0 returns cover all of it). Raises ConfigError when they don't divide."""
    if cfg.moe_layers and world > 1:
        raise ConfigError(f"--tp {world} does not split mixture-of-experts layers yet (run {cfg.architecture} on one)")
    for name, count in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP width", cfg.intermediate_size),
    ):
        if count % world:
            raise ConfigError(f"--tp {world} must divide the model's {name} ({count})")
    return replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
    )


def vocab_rows(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(first row, rows held, rows padded): rank r holds rows [r * n, r * n + held) of ceil(vocab / world) = n."""
    n = -(-vocab // world)
    first = min(rank * n, vocab)
    return first, min(n, vocab - first), n


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, then the bias once: x [T, in/N] -> [T, out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them reads zeros; one all-reduce sums them."""

    def __init__(self, vocab: int, hidden: int, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        self.first, _, rows = vocab_rows(vocab, comm.rank, comm.world)
        self.weight = nn.Parameter(torch.empty(rows, hidden))  # padded past the vocabulary with zeros

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.comm.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class ShardedDecoder(LlamaDecoder):
    """`LlamaDecoder` on one rank: `forward` as the whole model's (hidden states equal on every rank),
    `logits` the whole vocabulary's on rank 0 and an empty [S, 0] elsewhere.

    NOTE: build it on the meta device and assign the rank's shard (shard_loader.py); `cfg` is the
    rank's config (rank_config), `full` the model's."""

    def __init__(self, full: DecoderConfig, comm: Collectives, vocab_parallel: bool = True) -> None:
        super().__init__(rank_config(full, comm.world))
        self.full, self.comm, self.vocab_parallel = full, comm, vocab_parallel
        cfg = self.cfg
        for layer in self.layers:
            layer.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, comm)
            layer.down = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, comm)
        if vocab_parallel:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
            if self.lm_head is not None:
                rows = self.embed.weight.shape[0]
                self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)

    def logits(self, hidden: torch.Tensor, vocab_chunk: int = 0) -> torch.Tensor:
        """hidden [S, hidden] -> float32 logits [S, vocab] on rank 0, [S, 0] on the other ranks.

        NOTE: every rank must call it with the same rows (vocabulary-parallel: a gather)."""
        empty = hidden.new_empty(hidden.shape[0], 0, dtype=torch.float32)
        if not self.vocab_parallel:
            return super().logits(hidden, vocab_chunk) if self.comm.rank == 0 else empty
        gathered = self.comm.gather_columns(super().logits(hidden, vocab_chunk))
        if gathered is None:
            return empty
        vocab = self.cfg.vocab_size
        return gathered if gathered.shape[1] == vocab else gathered[:, :vocab].contiguous()

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters())
