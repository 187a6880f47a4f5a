"""Pure-decode steps in static shapes: one padded batch per (rows, width) bucket, captured as CUDA graphs.

A decode step of n sequences whose longest block table holds w blocks runs in the smallest bucket
with rows >= n and width >= w. Its inputs (ids, positions, KV slots, block tables padded to the
bucket's width, context lengths) are copied into static buffers; the forward and the LM head read
only those buffers and write float32 logits into a static output. On CUDA each bucket is captured
once at start-up (`torch.cuda.CUDAGraph`, after a warm-up) and replayed; elsewhere the same static
path runs eagerly, which is how the CPU tests check it against the normal path.

NOTE: the invariants that keep padding harmless:
- a padding row has token 0 at position 0, context length 1, and every entry of its block table
  is the scratch block, a block of the pool the block manager never hands out (the engine
  reserves it): its K/V write lands in the scratch block's first slot and its attention reads
  that one slot (never an empty context, whose softmax would be NaN);
- a real row's table is padded with the scratch block too, and the mask drops every key at or
  beyond its context length, so what the scratch block holds never reaches a real row;
- all graphs share one memory pool: they replay one after another, never concurrently;
- a bucket gathers rows x width blocks per layer, so buckets are kept to at most the pool's own
  number of blocks: one layer's gathered K/V never outgrow one layer's pools (with the in-place
  Triton kernel nothing is gathered, and the same grid is kept).
Mixed steps (any prefill), and decode steps larger than every bucket, run on the normal path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..device.cuda import CaptureStream
from ..models.attention import scaled_dot_product_attention
from ..models.decoder_config import DecoderConfig
from ..models.llama import LlamaDecoder
from .kvcache.pools import KVCache, KVLayout
from .scheduler import Chunk
from .staging import InFlightTokens


def graph_peak(
    model_cfg: DecoderConfig, layout: KVLayout, max_rows: int, max_blocks: int, gathers: bool = True
) -> Callable[[int], int]:
    """An upper bound on the memory the largest decode bucket takes while it runs, by pool size.

    `gathers`: the static path gathers K/V and runs SDPA; without (the in-place Triton kernel)
    only the step's activations and logits count.

    NOTE: with `--cuda-graphs` the pool must leave this much free: the graphs are captured after
    the pool exists, and their largest bucket gathers up to a whole layer's pool (rows x width <=
    pool blocks). The bound assumes SDPA's math kernel (what a mask with GQA gets on CUDA): the
    gathered K/V, repeated to every query head in float32, float32 scores and their softmax, the
    mask; then one step's activations and the logits (static, LM head output, float32 copy).
    Per key, as the CPU allocator measures the math kernel (tests/unit/test_generate_graphs.py): a half
    K/V upcast to float32, K and V repeated to every query head and K scaled once more, float32
    scores and their softmax.
    """
    cfg, elem = model_cfg, torch.empty(0, dtype=layout.dtype).element_size()
    heads, kv_heads, dim = cfg.num_heads, layout.num_kv_heads, layout.head_dim
    upcast = 2 * kv_heads * dim * 4 if elem < 4 else 0
    per_key = 2 * kv_heads * dim * elem + upcast + 3 * heads * dim * 4 + 2 * heads * 4 + elem + 1
    if layout.quantized:  # an FP8 cache is gathered as bytes before it is dequantized
        per_key += 2 * kv_heads * dim * torch.empty(0, dtype=layout.stored).element_size()
    per_key *= gathers
    per_row = 4 * (6 * cfg.hidden_size + 3 * cfg.intermediate_size + (heads + 2 * kv_heads) * dim)
    per_row += cfg.vocab_size * (4 + elem + (4 if elem < 4 else 0))  # static, LM head output, float32 copy
    rows, widest = buckets(max_rows)[-1], buckets(max_blocks)[-1]

    def peak(num_blocks: int) -> int:
        keys = min(num_blocks, rows * widest) * layout.block_size
        # NOTE: a quarter on top: CUDA's kernels and allocator (rounding, a graph pool's
        # fragmentation) may take more than the CPU allocator measures.
        return (keys * per_key + rows * per_row) * 5 // 4

    return peak


def buckets(limit: int) -> list[int]:
    """Powers of two below `limit`, then `limit` itself: 1, 2, 4, ..., limit."""
    return [*(1 << k for k in range(max(limit, 1).bit_length()) if 1 << k < limit), max(limit, 1)]


class StaticDecodeAttention:
    """Decode attention over static buffers: one query per row, every row gathers `width` blocks.

    `prepare` builds the step's mask from the static context lengths (inside the captured work);
    `__call__` writes this step's K/V by slot, then attends through the padded block tables:
    gathered for SDPA, or read in place by `kernel` (paged_kernel.paged_attention) when given.
    """

    name = "torch-static"
    gather_s = 0.0  # NOTE: not split out: on CUDA the work is asynchronous, on CPU it is the twin

    def __init__(
        self,
        cache: KVCache,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        kernel: Callable[..., torch.Tensor] | None = None,
        local_slots: torch.Tensor | None = None,
        local_tables: torch.Tensor | None = None,
    ) -> None:
        """`local_slots` [groups, rows], `local_tables` [groups, rows, width]: with paged windows,
        each group of sliding-window layers' slots and tables (kvcache/windowed_blocks.py)."""
        self.cache = cache
        self.slots, self.tables, self.lens = slots, tables, lens
        self.local_slots, self.local_tables = local_slots, local_tables
        self.kernel = kernel
        self._rows = torch.arange(tables.shape[0], device=cache.device)  # row i reads table i
        bs = cache.layout.block_size
        self._key_pos = torch.arange(tables.shape[1] * bs, device=cache.device)
        self.rows = self.width = 0
        self.windows = cache.layout.windows  # each layer's sliding window, 0: every key
        self.softcap = cache.layout.softcap
        self.masks: dict[int, torch.Tensor] = {}  # by window (0: the whole context)

    def prepare(self, rows: int, width: int) -> StaticDecodeAttention:
        """The step's masks, one for each window the layers have (inside the captured work)."""
        self.rows, self.width = rows, width
        if self.kernel is not None:
            return self
        keys = self._key_pos[: width * self.cache.layout.block_size][None, :]
        lens = self.lens[:rows, None]
        zero = torch.zeros((), dtype=self.cache.layout.dtype, device=keys.device)
        for window in {0, *self.windows}:
            inside = (keys < lens) & (keys > lens - 1 - window) if window else keys < lens
            self.masks[window] = torch.where(inside, zero, -torch.inf).view(rows, 1, 1, -1)
        return self

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [rows, H, D], k/v [rows, Hkv, D] -> [rows, H * D]; `sinks` [H]: gpt-oss's sink logits."""
        rows, width = self.rows, self.width
        slots, all_tables = self.slots, self.tables
        if (group := self.cache.table(layer)) >= 0:  # a paged window group's own blocks
            assert self.local_slots is not None and self.local_tables is not None
            slots, all_tables = self.local_slots[group], self.local_tables[group]
        self.cache.write(layer, slots[:rows], k, v)
        pool_k, pool_v = self.cache.keys(layer), self.cache.values(layer)
        window = self.windows[layer] if self.windows else 0
        if self.kernel is not None:
            tables, which = all_tables[:rows, :width], self._rows[:rows]
            out = self.kernel(
                q, pool_k, pool_v, tables, which, self.lens[:rows], window=window, softcap=self.softcap, sinks=sinks
            )
            return out.reshape(rows, -1)
        flat = all_tables[:rows, :width].reshape(-1)
        shape = (rows, -1, *pool_k.shape[2:])
        cache = self.cache
        kk = cache.dequantize(cache.raw(pool_k).index_select(0, flat), layer, key=True).view(shape)
        vv = cache.dequantize(cache.raw(pool_v).index_select(0, flat), layer, key=False).view(shape)
        out = scaled_dot_product_attention(
            q.unsqueeze(2), kk.transpose(1, 2), vv.transpose(1, 2), self.masks[window], False, self.softcap, sinks
        )
        return out.reshape(rows, -1)


class DecodeGraphs:
    """Static-shape decode for the runner: `run(decodes)` -> logits [n, vocab], or None (run it eagerly).

    `capture=True` (CUDA only) captures every bucket in the constructor, on a stream of the cache's
    device (`capture` does it later, on a given stream); otherwise each call runs the static path
    eagerly. `replays` and `eager_runs` count the steps each way.
    """

    def __init__(
        self,
        model: LlamaDecoder,
        cache: KVCache,
        scratch_block: int,
        max_rows: int,
        max_blocks: int,
        vocab_chunk: int = 0,
        capture: bool = False,
        kernel: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        if not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the pool of {cache.num_blocks}")
        device = cache.device
        self.model, self.cache, self.vocab_chunk = model, cache, vocab_chunk
        self.block_size = cache.layout.block_size
        self.scratch_block = scratch_block
        self.row_buckets, self.width_buckets = buckets(max_rows), buckets(max_blocks)
        self.grid = [(r, w) for r in self.row_buckets for w in self.width_buckets if r * w <= cache.num_blocks]
        rows, width = self.row_buckets[-1], self.width_buckets[-1]
        # Host staging (pinned on CUDA) and the static device buffers every graph reads.
        # NOTE: two host buffers in turn, as in staging.StepStaging: with the engine a step ahead,
        # a step's copy may still be queued when the next step is filled.
        # NOTE: each vector starts on a 16-byte boundary (rows rounded up to an even count of
        # int64), so the kernel's table and context pointers keep one alignment in every bucket.
        # NOTE: with paged windows, each window group's slots and tables follow (as many vectors
        # and tables again per group)
        self._stride = rows + rows % 2
        self.groups = groups = cache.layout.local_groups
        pin = device.type == "cuda"
        size = (1 + groups) * (rows * width) + (5 + groups) * self._stride
        self._hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._static = torch.zeros(size, dtype=torch.int64, device=device)
        vectors = self._static[: (5 + groups) * self._stride].view(5 + groups, self._stride)[:, :rows]
        self.ids, self.positions, self.slots, self.lens, self.from_ahead = vectors[:5]
        self.local_slots = vectors[5:]
        tables = self._static[(5 + groups) * self._stride :].view(1 + groups, rows, width)
        self.tables, self.local_tables = tables[0], tables[1:]
        self.logits = torch.zeros(rows, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.attention = StaticDecodeAttention(
            cache, self.slots, self.tables, self.lens, kernel, self.local_slots, self.local_tables
        )
        self._pad_all()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool: object | None = None
        self.replays = 0
        self.eager_runs = 0
        if capture:
            self.capture(CaptureStream(device))

    @property
    def captured(self) -> int:
        return len(self.graphs)

    def _pad_all(self) -> None:
        """Every row a padding row: what the buffers hold during warm-up and capture."""
        host, stride, groups = self._hosts[0], self._stride, self.groups
        scratch_slot = self.scratch_block * self.block_size
        host[: (5 + groups) * stride].view(5 + groups, stride)[:] = torch.tensor(
            [[0], [0], [scratch_slot], [1], [-1]] + [[scratch_slot]] * groups
        )
        host[(5 + groups) * stride :] = self.scratch_block
        self._static.copy_(host)

    def bucket(self, n: int, width: int) -> tuple[int, int] | None:
        """The (rows, width) bucket of a decode step, or None when it is larger than all of them."""
        return next(((r, w) for r, w in self.grid if r >= n and w >= width), None)

    @torch.inference_mode()
    def forward(self, rows: int, width: int) -> torch.Tensor:
        """The captured work: the model over the first `rows` static rows -> static logits [rows, vocab]."""
        attn = self.attention.prepare(rows, width)
        hidden = self.model(self.ids[:rows], self.positions[:rows], attn)
        self.logits[:rows].copy_(self.model.logits(hidden, self.vocab_chunk))
        return self.logits[:rows]

    def capture(self, stream: CaptureStream) -> None:
        """Warm-up, then every bucket captured, largest first (so the shared pool is sized by the
        largest), all on `stream` (see CaptureStream); CUDA only."""
        self.pool = torch.cuda.graph_pool_handle()
        largest = sorted(self.grid, key=lambda b: (b[0] * b[1], b), reverse=True)
        # NOTE: lazy initialisation (cuBLAS handles and workspace, autotuning, Triton's compile)
        # stays out of the graphs
        stream.warm_up(lambda: self.forward(*largest[0]))
        for rows, width in largest:
            self.graphs[(rows, width)] = stream.capture(lambda r=rows, w=width: self.forward(r, w), self.pool)
        stream.synchronize()

    def run(self, decodes: list[Chunk], ahead: InFlightTokens | None = None) -> torch.Tensor | None:
        """Logits [n, vocab] float32 for a pure-decode step, in `decodes` order; None if no bucket fits.

        `ahead`: the step in flight, whose sampled tokens are the inputs still PENDING here.

        NOTE: the result is a view of the static output: the caller samples from it before the
        next step replays over it.
        """
        n = len(decodes)
        widest = max(len(c.seq.block_table) for c in decodes)
        fit = self.bucket(n, widest)
        if fit is None:
            return None
        rows, width = fit
        if self._fill(decodes, rows, width, ahead):
            assert ahead is not None
            self.ids[:rows].copy_(ahead.fill(self.ids[:rows], self.from_ahead[:rows]))
        graph = self.graphs.get(fit)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self.forward(rows, width)
            self.eager_runs += 1
        return self.logits[:n]

    def _fill(self, decodes: list[Chunk], rows: int, width: int, ahead: InFlightTokens | None) -> bool:
        """Real rows first, padding rows after; tables padded with the scratch block; one copy to the
        device. True when some input is still in flight (`from_ahead` says where to take it)."""
        bs, n, full_rows, stride = self.block_size, len(decodes), self.row_buckets[-1], self._stride
        groups = self.groups
        buffer = self._hosts[self._turn]
        self._turn ^= 1
        host = buffer.numpy()
        vectors = host[: (5 + groups) * stride].reshape(5 + groups, stride)
        ids, pos, slots, lens, from_ahead = vectors[:5]
        local_slots = vectors[5:]
        every_table = host[(5 + groups) * stride :].reshape(1 + groups, full_rows, -1)
        tables, local_tables = every_table[0], every_table[1:]
        every_table[:, :rows, :width] = self.scratch_block
        for row, chunk in enumerate(decodes):
            seq, p = chunk.seq, chunk.start
            table = seq.block_table
            ids[row], pos[row], lens[row] = seq.tokens[p], p, p + 1
            from_ahead[row] = -1 if ahead is None else ahead.index_of(seq, p)
            slots[row] = table[p // bs] * bs + p % bs
            tables[row, : len(table)] = table
            for j, local in enumerate(seq.local_tables):  # NOTE: the window's blocks only (runner.py)
                local_slots[j, row] = local[p // bs] * bs + p % bs
                local_tables[j, row, seq.window_from : len(local)] = local[seq.window_from :]
        ids[n:rows], pos[n:rows], lens[n:rows], from_ahead[n:rows] = 0, 0, 1, -1
        slots[n:rows] = self.scratch_block * bs
        local_slots[:, n:rows] = self.scratch_block * bs
        # NOTE: one host-to-device copy of the whole staging area; rows and columns outside the
        # bucket are never read by its graph.
        self._static.copy_(buffer, non_blocking=True)
        return bool((from_ahead[:n] >= 0).any())
