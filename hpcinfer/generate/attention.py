"""Attention over block tables: this step's K/V go into the paged pools, queries read through them.

One seam, chosen once at start-up (`choose_attention`): the pure-torch path here is correct on
CPU and CUDA; a CUDA kernel library can replace it behind the same call. The batch layout is
the runner's (`PagedBatch`): decode tokens first (one per sequence), then prefill chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_cache import KVCache


@dataclass(slots=True)
class PrefillSegment:
    """`length` query tokens at flat offset `offset`, positions start..start+length-1 of their sequence."""

    offset: int
    length: int
    start: int
    blocks: torch.Tensor  # [ceil((start + length) / block_size)] block ids; used only when start > 0
    mask: torch.Tensor | None = None  # [length, start + length] causal over the cached context


@dataclass(slots=True)
class DecodeGroup:
    """`count` decode tokens (one per sequence) at flat offset `offset`, of similar context length."""

    offset: int
    count: int
    blocks: torch.Tensor  # [count, width] block ids (padded with stale ids, masked out)
    mask: torch.Tensor  # [count, 1, 1, width * block_size] additive: 0 in context, -inf beyond


@dataclass(slots=True)
class PagedBatch:
    """One step's attention metadata, shared by every layer (built once per step by the runner)."""

    slots: torch.Tensor  # [T] flat KV slot of each token
    decodes: list[DecodeGroup] = field(default_factory=list)  # flat rows 0..num_decodes-1
    prefills: list[PrefillSegment] = field(default_factory=list)  # after the decodes


class TorchPagedAttention:
    """The reference paged attention (SDPA over gathered blocks). `gather_s` times the gathers."""

    name = "torch"

    def __init__(self, cache: KVCache, timed: bool = False) -> None:
        self.cache = cache
        self.batch: PagedBatch | None = None
        self.timed = timed
        self.gather_s = 0.0
        self._kbuf = cache.k.new_empty(0, *cache.k.shape[2:])
        self._vbuf = cache.v.new_empty(0, *cache.v.shape[2:])

    def bind(self, batch: PagedBatch) -> TorchPagedAttention:
        self.batch = batch
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        batch = self.batch
        assert batch is not None, "bind() a step's PagedBatch first"
        self.cache.write(layer, batch.slots, k, v)
        t, heads, dim = q.shape
        if len(batch.decodes) == 1 and not batch.prefills:
            return self._decode(layer, batch.decodes[0], q).reshape(t, heads * dim)
        out = q.new_empty(t, heads, dim)
        for group in batch.decodes:
            rows = slice(group.offset, group.offset + group.count)
            out[rows] = self._decode(layer, group, q[rows])
        for seg in batch.prefills:
            rows = slice(seg.offset, seg.offset + seg.length)
            out[rows] = self._prefill(layer, seg, q[rows], k[rows], v[rows])
        return out.view(t, heads * dim)

    def _gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [..., nb] -> K, V [..., nb * block_size, Hkv, D], copied into reused buffers.

        NOTE: the buffers grow to the largest step seen and are then reused: a fresh multi-MiB
        tensor per layer and step costs page faults that make the gather several times slower.
        """
        start = time.perf_counter() if self.timed else 0.0
        pool_k, pool_v = self.cache.k[layer], self.cache.v[layer]
        flat = blocks.reshape(-1)
        n = flat.numel()
        if self._kbuf.shape[0] < n:
            size = max(n, 2 * self._kbuf.shape[0])
            self._kbuf = pool_k.new_empty(size, *pool_k.shape[1:])
            self._vbuf = pool_v.new_empty(size, *pool_v.shape[1:])
        shape = (*blocks.shape[:-1], -1, *pool_k.shape[2:])
        kk = torch.index_select(pool_k, 0, flat, out=self._kbuf[:n]).view(shape)
        vv = torch.index_select(pool_v, 0, flat, out=self._vbuf[:n]).view(shape)
        if self.timed:
            self.gather_s += time.perf_counter() - start
        return kk, vv

    def _decode(self, layer: int, group: DecodeGroup, q: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], one query per sequence -> [n, H, D]."""
        kk, vv = self._gather(layer, group.blocks)  # [n, L, Hkv, D]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=group.mask, enable_gqa=True
        )
        return out.squeeze(2)

    def _prefill(
        self, layer: int, seg: PrefillSegment, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [n, H, D] -> [n, H, D], causal; keys from this step alone or the cached context too.

        NOTE: batched 4-D inputs [1, H, n, D]: SDPA's CPU flash kernel takes only those; 3-D ones
        go to the math path, which materialises the scores and runs about half as fast.
        """
        if seg.start == 0:
            out = F.scaled_dot_product_attention(
                _heads_first(q), _heads_first(k), _heads_first(v), is_causal=True, enable_gqa=True
            )
            return out[0].transpose(0, 1)
        kk, vv = self._gather(layer, seg.blocks)
        total = seg.start + seg.length
        out = F.scaled_dot_product_attention(
            _heads_first(q),
            _heads_first(kk[:total]),
            _heads_first(vv[:total]),
            attn_mask=seg.mask,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, D] -> a [1, heads, n, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def choose_attention(cache: KVCache, device: torch.device, timed: bool = False) -> TorchPagedAttention:
    """The attention implementation for this run, chosen once.

    NOTE: the pure-torch path is the one every device runs today; a paged CUDA kernel (flash-attn's
    `flash_attn_with_kvcache`, flashinfer) slots in here behind the same `bind`/`__call__` contract.
    """
    return TorchPagedAttention(cache, timed=timed)
