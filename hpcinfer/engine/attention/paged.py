"""Attention over block tables: this step's K/V go into the paged pools, queries read through them.

One seam, chosen once at start-up (`attention_choice.choose_attention`): the pure-torch path here is correct on
CPU and CUDA; on CUDA flash-attn's paged kernel or a Triton kernel (paged_kernel.py) replace it
behind the same `bind`/`__call__`, reading K/V blocks in place instead of gathering them. The batch layout is
the runner's (`PagedBatch`): decode tokens first (one per sequence), then prefill chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ...models.attention import scaled_dot_product_attention, windowed_attention
from ..kvcache.pools import KVCache


@dataclass(slots=True)
class PrefillSegment:
    """`length` query tokens at flat offset `offset`, positions start..start+length-1 of their sequence."""

    offset: int
    length: int
    start: int
    blocks: torch.Tensor  # [ceil((start + length) / block_size)] block ids (the torch path reads them if start > 0)
    mask: torch.Tensor | None = None  # [length, start + length] causal over the cached context


@dataclass(slots=True)
class DecodeGroup:
    """`count` decode tokens (one per sequence) at flat offset `offset`, of similar context length."""

    offset: int
    count: int
    blocks: torch.Tensor  # [count, width] block ids (padded with stale ids, masked out)
    mask: torch.Tensor  # [count, 1, 1, width * block_size] additive: 0 in context, -inf beyond
    lens: torch.Tensor | None = None  # [count] context lengths, this step's token included


@dataclass(slots=True)
class KernelTokens:
    """The tokens an in-place paged kernel serves (paged_kernel.py): each with its table row and context."""

    tokens: torch.Tensor  # [N] flat indices into the step's tokens
    tables: torch.Tensor  # [R, width] block ids, padded
    rows: torch.Tensor  # [N] each token's row of `tables`
    context: torch.Tensor  # [N] keys each token sees: its position + 1
    every_token: bool  # tokens is 0..T-1: no index_select needed


@dataclass(slots=True)
class PagedBatch:
    """One step's attention metadata, shared by every layer (built once per step by the runner)."""

    slots: torch.Tensor  # [T] flat KV slot of each token
    decodes: list[DecodeGroup] = field(default_factory=list)  # flat rows 0..num_decodes-1
    prefills: list[PrefillSegment] = field(default_factory=list)  # after the decodes
    kernel: KernelTokens | None = None  # for the Triton path: decodes and continued prefill chunks
    # paged windows: each group of sliding-window layers' view, its slots and tables (runner._local_batch)
    local: list[PagedBatch] = field(default_factory=list)


_Bound = TypeVar("_Bound", bound="_BoundToStep")
_T = TypeVar("_T")


class _BoundToStep:
    """What every paged attention does first: take a step's batch (`bind`), write this step's K/V."""

    cache: KVCache
    batch: PagedBatch | None = None

    def bind(self: _Bound, batch: PagedBatch) -> _Bound:
        self.batch = batch
        return self

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PagedBatch:
        """Writes this step's K/V of `layer`; returns the step's batch as that layer reads it."""
        batch = self.batch
        assert batch is not None, "bind() a step's PagedBatch first"
        if (table := self.cache.table(layer)) >= 0:
            batch = batch.local[table]
        self.cache.write(layer, batch.slots, k, v)
        return batch


def causal_self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A fresh prefill chunk (every key is this step's): q [n, H, D], k/v [n, Hkv, D] -> [n, H, D].

    NOTE: batched 4-D inputs [1, H, n, D]: SDPA's CPU flash kernel takes only those; 3-D ones go to
    the math path, which materialises the scores and runs about half as fast. No mask: on CUDA it
    runs the flash kernel. A sliding-window layer's chunk longer than its window passes its
    `window_mask` [n, n] instead; Gemma 2's `softcap` caps the scores.
    """
    q4, k4, v4 = _heads_first(q), _heads_first(k), _heads_first(v)
    out = scaled_dot_product_attention(q4, k4, v4, window_mask, window_mask is None, softcap, sinks)
    return out[0].transpose(0, 1)


class TorchPagedAttention(_BoundToStep):
    """The reference paged attention (SDPA over gathered blocks). `gather_s` times the gathers."""

    name = "torch"

    def __init__(self, cache: KVCache, timed: bool = False) -> None:
        self.cache = cache
        self.batch: PagedBatch | None = None
        self.timed = timed
        self.gather_s = 0.0
        self.windows = cache.layout.windows  # each layer's sliding window, 0: every key
        self.softcap = cache.layout.softcap
        self._window_masks: dict[tuple[int, int], Any] = {}  # (id of a group or segment, window): this step's
        self._kbuf = cache.raw(cache.k).new_empty(0, *cache.k.shape[2:])
        self._vbuf = cache.raw(cache.v).new_empty(0, *cache.v.shape[2:])

    def bind(self, batch: PagedBatch) -> TorchPagedAttention:  # type: ignore[override]
        self._window_masks.clear()  # the step's masks, made by the first layer of each window that needs them
        return super().bind(batch)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]; `sinks` [H]: gpt-oss's per-head sink logits."""
        batch = self._write(layer, k, v)
        t, heads, dim = q.shape
        if len(batch.decodes) == 1 and not batch.prefills:
            return self._decode(layer, batch.decodes[0], q, sinks).reshape(t, heads * dim)
        out = q.new_empty(t, heads, dim)
        for group in batch.decodes:
            rows = slice(group.offset, group.offset + group.count)
            out[rows] = self._decode(layer, group, q[rows], sinks)
        for seg in batch.prefills:
            rows = slice(seg.offset, seg.offset + seg.length)
            out[rows] = self._prefill(layer, seg, q[rows], k[rows], v[rows], sinks)
        return out.view(t, heads * dim)

    def _gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [..., nb] -> K, V [..., nb * block_size, Hkv, D], copied into reused buffers.

        NOTE: the buffers grow to the largest step seen and are then reused: a fresh multi-MiB
        tensor per layer and step costs page faults that make the gather several times slower.
        """
        start = time.perf_counter() if self.timed else 0.0
        cache = self.cache
        pool_k, pool_v = cache.raw(cache.keys(layer)), cache.raw(cache.values(layer))
        flat = blocks.reshape(-1)
        n = flat.numel()
        if self._kbuf.shape[0] < n:
            size = max(n, 2 * self._kbuf.shape[0])
            self._kbuf = pool_k.new_empty(size, *pool_k.shape[1:])
            self._vbuf = pool_v.new_empty(size, *pool_v.shape[1:])
        shape = (*blocks.shape[:-1], -1, *pool_k.shape[2:])
        kk = cache.dequantize(torch.index_select(pool_k, 0, flat, out=self._kbuf[:n]), layer, key=True).view(shape)
        vv = cache.dequantize(torch.index_select(pool_v, 0, flat, out=self._vbuf[:n]), layer, key=False).view(shape)
        if self.timed:
            self.gather_s += time.perf_counter() - start
        return kk, vv

    def _per_step(self, of: object, window: int, make: Callable[[], _T]) -> _T:
        """What `make` builds for a group or segment and a window, once a step (the first layer of
        that window builds it, the others reuse it)."""
        key = (id(of), window)
        if key not in self._window_masks:
            self._window_masks[key] = make()
        return self._window_masks[key]

    def _decode(
        self, layer: int, group: DecodeGroup, q: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [n, H, D], one query per sequence -> [n, H, D]. A sliding-window layer gathers only
        the blocks each row's window reaches (a long context's attention costs its window's)."""
        blocks, mask = group.blocks, group.mask
        if window := (self.windows[layer] if self.windows else 0):
            blocks, mask = self._per_step(group, window, lambda: self._window_blocks(group, window))
        kk, vv = self._gather(layer, blocks)  # [n, L, Hkv, D]
        n, heads, dim = q.shape
        kv_heads = kk.shape[2]
        if heads != kv_heads and sinks is None and not self.softcap:
            # NOTE: one query a row, so a KV head's group of query heads attends as that many queries
            # of one head (the mask is the same for each): SDPA's CPU kernel then reads each gathered
            # K and V once for the group, where grouped-query SDPA reads it once a query head (4
            # query heads a KV head, 11 rows of 112 keys: 81 us against 200-267 us)
            grouped = q.reshape(n, kv_heads, heads // kv_heads, dim)
            out = scaled_dot_product_attention(grouped, kk.transpose(1, 2), vv.transpose(1, 2), mask)
            return out.reshape(n, heads, dim)
        out = scaled_dot_product_attention(
            q.unsqueeze(2), kk.transpose(1, 2), vv.transpose(1, 2), mask, softcap=self.softcap, sinks=sinks
        )
        return out.squeeze(2)

    def _window_blocks(self, group: DecodeGroup, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of each row's window ([n, span], span the most a window of `window` keys
        touches, from the first block it reaches) and their additive mask: a key is seen when
        it is in the context and position - key < window."""
        lens = group.lens
        assert lens is not None, "decode groups carry their context lengths"
        bs, (n, width) = self.cache.layout.block_size, group.blocks.shape
        span = min(width, -(-(window - 1) // bs) + 1)
        first = (lens - window).clamp(min=0) // bs if span < width else torch.zeros_like(lens)
        index = first[:, None] + torch.arange(span, device=lens.device)[None, :]  # [n, span]
        # NOTE: indices past a row's table read its padding (masked: their positions are past the context)
        blocks = group.blocks.gather(1, index.clamp(max=width - 1))
        keys = (index[:, :, None] * bs + torch.arange(bs, device=lens.device)).reshape(n, span * bs)
        seen = (keys < lens[:, None]) & (keys > (lens - 1 - window)[:, None])
        mask = torch.zeros(seen.shape, dtype=group.mask.dtype, device=seen.device).masked_fill_(~seen, -torch.inf)
        return blocks, mask.view(n, 1, 1, span * bs)

    def _prefill(
        self,
        layer: int,
        seg: PrefillSegment,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [n, H, D] -> [n, H, D], causal; keys from this step alone or the cached context too
        (on a sliding-window layer, from the first block its first query's window reaches)."""
        window = self.windows[layer] if self.windows else 0
        total = seg.start + seg.length
        bs = self.cache.layout.block_size
        windowed = window and total > window  # NOTE: a shorter context's window is all of it
        first = max(0, seg.start - window + 1) // bs if windowed else 0  # the first block any query sees
        if seg.start == 0:
            if windowed:
                out = windowed_attention(*map(_heads_first, (q, k, v)), 0, 0, window, self.softcap, sinks)
                return out[0].transpose(0, 1)
            return causal_self_attention(q, k, v, None, self.softcap, sinks)
        kk, vv = self._gather(layer, seg.blocks[first:])
        seen = total - first * bs
        q4, k4, v4 = _heads_first(q), _heads_first(kk[:seen]), _heads_first(vv[:seen])
        if windowed:
            out = windowed_attention(q4, k4, v4, seg.start, first * bs, window, self.softcap, sinks)
        else:
            out = scaled_dot_product_attention(q4, k4, v4, seg.mask, softcap=self.softcap, sinks=sinks)
        return out[0].transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, D] -> a [1, heads, n, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


class FlashAttnPagedAttention(_BoundToStep):
    """flash-attn 2's paged kernel: `flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)`.

    The pools already have its paged layout, [num_blocks, block_size, Hkv, D]. This step's K/V are
    written by slot first (as on the torch path), so the kernel runs with k = v = None and
    cache_seqlens = each query's whole context; its causal mask is aligned to the bottom right,
    so a chunk's query i sees the keys up to its own position. A sliding-window layer passes
    `window_size` (keys up to window - 1 positions back: a key is seen when position - key <
    window) and Gemma 2 its `softcap`. `fn` is the library function.
    """

    name = "flash-attn"

    def __init__(self, cache: KVCache, fn: Callable[..., torch.Tensor]) -> None:
        self.cache = cache
        self.fn = fn
        self.gather_s = 0.0  # no gathers: the kernel reads the blocks in place
        self.batch: PagedBatch | None = None
        # the step's calls, then each paged window group's
        self._calls: list[list[tuple[slice, bool, torch.Tensor, torch.Tensor]]] = []
        self.windows = cache.layout.windows  # each layer's sliding window, 0: every key
        # NOTE: only what a model needs is passed: flash-attn before 2.6 has no softcap argument
        self._capped = {"softcap": cache.layout.softcap} if cache.layout.softcap else {}

    def bind(self, batch: PagedBatch) -> FlashAttnPagedAttention:  # type: ignore[override]
        """Converts the step's tables and lengths once to the kernel's int32, for every layer."""
        self.batch = batch
        self._calls = [self._calls_of(view) for view in (batch, *batch.local)]
        return self

    @staticmethod
    def _calls_of(batch: PagedBatch) -> list[tuple[slice, bool, torch.Tensor, torch.Tensor]]:
        calls = []
        for group in batch.decodes:
            assert group.lens is not None, "decode groups carry their context lengths"
            rows = slice(group.offset, group.offset + group.count)
            calls.append((rows, True, group.blocks.to(torch.int32), group.lens.to(torch.int32)))
        for seg in batch.prefills:
            rows = slice(seg.offset, seg.offset + seg.length)
            total = torch.full((1,), seg.start + seg.length, dtype=torch.int32, device=seg.blocks.device)
            calls.append((rows, False, seg.blocks.to(torch.int32)[None, :], total))
        return calls

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        self._write(layer, k, v)
        calls = self._calls[self.cache.table(layer) + 1]  # the step's, or its paged window group's
        t, heads, dim = q.shape
        pool_k, pool_v = self.cache.keys(layer), self.cache.values(layer)
        window = self.windows[layer] if self.windows else 0
        options = {**self._capped, **({"window_size": (window - 1, 0)} if window else {})}
        out = q.new_empty(t, heads, dim)
        for rows, decode, table, lens in calls:
            # decodes: [n, 1, H, D], one query per sequence; a prefill chunk: [1, n, H, D]
            query = q[rows].unsqueeze(1) if decode else q[rows].unsqueeze(0)
            got = self.fn(query, pool_k, pool_v, cache_seqlens=lens, block_table=table, causal=True, **options)
            out[rows] = got.squeeze(1) if decode else got[0]
        return out.view(t, heads * dim)


class TritonPagedAttention(_BoundToStep):
    """The Triton kernel (paged_kernel.py) reads K/V blocks in place for decodes and continued
    prefill chunks, in one launch a layer; a fresh prefill chunk (its keys are all this step's)
    runs SDPA's causal kernel on its own K/V, which needs no mask (flash on CUDA) unless it is
    longer than its layer's sliding window. Windows, Gemma 2's soft cap and gpt-oss's sinks are
    the kernel's too."""

    name = "triton"
    gather_s = 0.0  # no gathers

    def __init__(self, cache: KVCache) -> None:
        from .triton_kernel import paged_attention

        self.cache = cache
        self.kernel = paged_attention
        self.batch: PagedBatch | None = None
        self.windows = cache.layout.windows  # each layer's sliding window, 0: every key
        self.softcap = cache.layout.softcap
        self._window_masks: dict[tuple[int, int], torch.Tensor] = {}  # (id of a segment, window): this step's

    def bind(self, batch: PagedBatch) -> TritonPagedAttention:  # type: ignore[override]
        self._window_masks.clear()
        return super().bind(batch)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]; `sinks` [H]: gpt-oss's per-head sink logits."""
        batch = self._write(layer, k, v)
        t, heads, dim = q.shape
        pool_k, pool_v = self.cache.keys(layer), self.cache.values(layer)
        window = self.windows[layer] if self.windows else 0
        reads = {"window": window, "softcap": self.softcap, "sinks": sinks}
        paged = batch.kernel
        if paged is not None and paged.every_token:
            out = self.kernel(q, pool_k, pool_v, paged.tables, paged.rows, paged.context, **reads)
            return out.view(t, heads * dim)
        out = q.new_empty(t, heads, dim)
        if paged is not None:
            picked = q.index_select(0, paged.tokens)
            got = self.kernel(picked, pool_k, pool_v, paged.tables, paged.rows, paged.context, **reads)
            out.index_copy_(0, paged.tokens, got)
        for seg in batch.prefills:
            if seg.start == 0:
                rows = slice(seg.offset, seg.offset + seg.length)
                if window and seg.length > window:
                    got = windowed_attention(*map(_heads_first, (q[rows], k[rows], v[rows])), 0, 0, window,
                                             self.softcap, sinks)  # fmt: skip
                    out[rows] = got[0].transpose(0, 1)
                else:
                    out[rows] = causal_self_attention(q[rows], k[rows], v[rows], None, self.softcap, sinks)
        return out.view(t, heads * dim)
