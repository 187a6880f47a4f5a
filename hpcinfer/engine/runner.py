"""The device side of an engine step: a StepPlan becomes flat tensors, the model runs, logits come back.

Consumes a `StepPlan` (decodes first, then prefill chunks); produces float32 logits [S, vocab]
for the S chunks that sample, in `plan.chunks` order. Host index buffers are allocated once at
start-up and filled in place each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..device.cpu_shape import decode_group_bytes, matmul_slice_rows
from ..models.llama import LlamaDecoder
from ..models.lora import LoraRows
from .attention.choice import choose_attention
from .attention.paged import DecodeGroup, KernelTokens, PagedBatch, PrefillSegment, TritonPagedAttention
from .decode_graphs import DecodeGraphs
from .kvcache.block_manager import blocks_for
from .kvcache.pools import KVCache
from .sample.sampling import greedy
from .scheduler import StepPlan
from .staging import InFlightTokens, StepStaging
from .step_rows import logprob_chunks, media_rows, row_adapters

MAX_DECODE_GROUPS = 4  # decodes split by context length: less padding, a few more attention calls
MIN_GROUP = 16
# NOTE: on CPU the torch path gathers each decode group's K/V into a buffer that SDPA then reads;
# a group whose gathered K/V fit in `decode_group_bytes` (twice one core's L2) is still in cache
# when SDPA reads it. Measured on one core with a 2 MiB L2 (32 sequences of 192-320 keys, 8 heads,
# 4 MiB groups): 1.5-1.8x faster per layer than four groups of 32, though it makes more, smaller
# attention calls.
# NOTE: on CPU, MKL ran the LM head [S, hidden] x [hidden, vocab] at about half its usual FLOP/s
# when the whole vocabulary was one matmul (measured 26-37 GFLOP/s against 50-63 in slices of 512
# rows, one core, S = 64-128); slices are sized to this CPU's L2 (`matmul_slice_rows`), and the
# logits are bit for bit the same.


@dataclass(slots=True)
class StepInputs:
    """What the device needs of a step, built on the host: its index arrays (sent in one copy) and
    how they split into decode groups and prefill segments. Plain arrays and ints: under tensor
    parallelism rank 0 sends it to the other ranks, which build the same batch from it."""

    # from_ahead, ids, positions, slots, sample_at, lens, group tables, chunk tables, kernel; then,
    # with paged windows, per local table: its slots, group tables, chunk tables and kernel table
    arrays: list[np.ndarray]
    num_decodes: int
    num_tokens: int
    bounds: list[tuple[int, int]]  # decode groups' [start, end) rows
    spans: list[tuple[int, int, int]]  # prefill chunks' (flat offset, length, start position)
    kernel: bool  # the arrays end with an in-place kernel's (tokens, tables, rows, context)
    pending: bool  # some decode inputs are the step in flight's tokens (`from_ahead`)
    logprob_rows: list[tuple[int, int]]  # (flat offset, count) of the rows whose prompt log-probabilities are asked


class ModelRunner:
    def __init__(
        self,
        model: LlamaDecoder,
        cache: KVCache,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        timed: bool = False,
        scratch_block: int | None = None,
        attention: str = "auto",
    ) -> None:
        """`scratch_block` (a block no sequence owns) turns on the static-shape decode path
        (`decode_graphs.py`): captured as CUDA graphs on CUDA, run eagerly elsewhere."""
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.layout.block_size
        # NOTE: gathers are timed on the host, which is their device only on the CPU: on CUDA that
        # would time their launch, and their work stays in the forward's device time.
        self.attention = choose_attention(cache, self.device, attention, timed and self.device.type == "cpu")
        tokens = max_num_batched_tokens + max_num_seqs  # decodes may fill the budget exactly, plus slack
        self.max_blocks = blocks_for(max_model_len, self.block_size)
        # Host index arrays, filled in place each step, then sent to the device in one copy.
        self._ids = np.zeros(tokens, dtype=np.int64)
        self._pos = np.zeros(tokens, dtype=np.int64)
        self._slots = np.zeros(tokens, dtype=np.int64)
        self._tables = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int64)
        self._lens = np.zeros(max_num_seqs, dtype=np.int64)
        self._sample_at = np.zeros(max_num_seqs, dtype=np.int64)
        self._widths = np.zeros(max_num_seqs, dtype=np.int64)
        self._from_ahead = np.zeros(max_num_seqs, dtype=np.int64)  # a decode's input: its row in the step ahead
        # paged windows (kvcache/windowed_blocks.py): the sliding-window layers' tables, one a group
        self.local_groups = cache.layout.local_groups
        self._local_slots = np.zeros((self.local_groups, tokens), dtype=np.int64)
        self._local_tables = np.zeros((self.local_groups, max_num_seqs, self.max_blocks), dtype=np.int64)
        self._key_pos = torch.arange(self.max_blocks * self.block_size, device=self.device)
        # NOTE: sized for tables of up to 64 blocks a sequence; it grows on the first longer steps.
        self.staging = StepStaging(self.device, 3 * tokens + 2 * max_num_seqs * (1 + min(self.max_blocks, 64)))
        row_bytes = model.cfg.hidden_size * model.norm.element_size()  # one row of the LM head's weight
        self.vocab_chunk = matmul_slice_rows(row_bytes) if self.device.type == "cpu" else 0
        self.group_bytes = decode_group_bytes()
        self.graphs = None
        self.lora_rows: LoraRows | None = None  # set: each step says which rows each LoRA adapter answers
        # Tensor parallelism (rank 0): sends each step's inputs to the other ranks before its forward.
        self.mirror: Callable[[StepInputs], None] | None = None
        if scratch_block is not None:
            capture = self.device.type == "cuda"
            kernel = self.attention.kernel if isinstance(self.attention, TritonPagedAttention) else None
            self.graphs = DecodeGraphs(
                model, cache, scratch_block, max_num_seqs, self.max_blocks, self.vocab_chunk, capture, kernel
            )

    def prepare(
        self, plan: StepPlan, ahead: InFlightTokens | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, PagedBatch, torch.Tensor]:
        """ids [T], positions [T], the attention batch, and the flat index of each sampling token."""
        return self.device_inputs(self.host_inputs(plan, ahead), ahead)

    def host_inputs(self, plan: StepPlan, ahead: InFlightTokens | None = None) -> StepInputs:
        """The step's index arrays, filled on the host from the plan (the host buffers, reused next step)."""
        bs = self.block_size
        nd = len(plan.decodes)
        # NOTE: decodes run shortest context first, so each group of them pads its gathered
        # context to a width close to its own; the sampled rows are mapped back to plan order.
        order = sorted(range(nd), key=lambda i: len(plan.decodes[i].seq.block_table))
        for row, i in enumerate(order):
            seq, p = plan.decodes[i].seq, plan.decodes[i].start
            self._ids[row] = seq.tokens[p]
            self._from_ahead[row] = -1 if ahead is None else ahead.index_of(seq, p)
            self._pos[row] = p
            self._slots[row] = seq.block_table[p // bs] * bs + p % bs
            self._tables[row, : len(seq.block_table)] = seq.block_table
            # NOTE: a window's blocks only: the places before it keep stale ids, which no path reads
            # unmasked (each starts at its window's first block, or masks what is before it)
            for j, local in enumerate(seq.local_tables):
                self._local_slots[j, row] = local[p // bs] * bs + p % bs
                self._local_tables[j, row, seq.window_from : len(local)] = local[seq.window_from :]
            self._widths[row] = len(seq.block_table)
            self._lens[row] = p + 1
            self._sample_at[i] = row
        offset, spans, tables = nd, [], []
        local_tables: list[list[np.ndarray]] = [[] for _ in range(self.local_groups)]
        for chunk in plan.prefills:
            seq, n, p = chunk.seq, chunk.length, chunk.start
            end = offset + n
            self._ids[offset:end] = seq.tokens[p : p + n]
            pos = np.arange(p, p + n)
            self._pos[offset:end] = pos
            table = np.asarray(seq.block_table, dtype=np.int64)
            self._slots[offset:end] = table[pos // bs] * bs + pos % bs
            spans.append((offset, n, p))
            tables.append(table[: blocks_for(p + n, bs)])
            for j, local in enumerate(seq.local_tables):
                local = np.asarray(local, dtype=np.int64)
                self._local_slots[j, offset:end] = local[pos // bs] * bs + pos % bs
                local_tables[j].append(local[: blocks_for(p + n, bs)])
            offset = end
        sample_rows = nd  # every decode samples
        for (start, n, _), chunk in zip(spans, plan.prefills, strict=True):
            if chunk.samples:
                self._sample_at[sample_rows] = start + n - 1
                sample_rows += 1
        in_place = self.attention.name == "triton"
        bounds = [] if in_place else self._group_bounds(nd)
        group_tables = [self._tables[s:e, : self._widths[e - 1]] for s, e in bounds]
        kernel = self._kernel_arrays(nd, spans, tables) if in_place else []
        windowed = []  # paged windows: each group's slots, group tables, chunk tables, kernel table
        for j, chunk_tables in enumerate(local_tables):
            decode_tables = self._local_tables[j]
            windowed += [self._local_slots[j, :offset], *[decode_tables[s:e, : self._widths[e - 1]] for s, e in bounds]]
            windowed += chunk_tables
            if kernel:
                windowed.append(self._kernel_table(nd, spans, chunk_tables, decode_tables, kernel[1].shape[1]))
        pending = ahead is not None and bool((self._from_ahead[:nd] >= 0).any())
        arrays = [
            self._from_ahead[: nd if pending else 0],
            self._ids[:offset],
            self._pos[:offset],
            self._slots[:offset],
            self._sample_at[:sample_rows],
            self._lens[:nd],
            *group_tables,
            *tables,
            *kernel,
            *windowed,
        ]
        logprob_rows = [(start, n) for _, start, n in logprob_chunks(plan)]
        return StepInputs(arrays, nd, offset, bounds, spans, bool(kernel), pending, logprob_rows)

    def device_inputs(
        self, step: StepInputs, ahead: InFlightTokens | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, PagedBatch, torch.Tensor]:
        """The step's arrays on the device in one copy (`StepStaging`), and its attention batch;
        the masks are built on the device from the copied lengths."""
        nd, bounds, spans = step.num_decodes, step.bounds, step.spans
        from_ahead, ids, pos, slots, sample_at, lens, *rest = self.staging.send(step.arrays)
        if step.pending:
            assert ahead is not None
            ids[:nd] = ahead.fill(ids[:nd], from_ahead)
        blocks = rest[: len(bounds) + len(spans)]
        groups = [self._decode_group(s, e, lens, b) for (s, e), b in zip(bounds, blocks, strict=False)]
        segments = [
            self._segment(start, n, p, b) for (start, n, p), b in zip(spans, blocks[len(bounds) :], strict=True)
        ]
        batch = PagedBatch(slots=slots, decodes=groups, prefills=segments)
        rest = rest[len(blocks) :]
        if step.kernel:
            tokens, table, rows, context = rest[:4]
            batch.kernel = KernelTokens(tokens, table, rows, context, every_token=tokens.shape[0] == step.num_tokens)
            rest = rest[4:]
        each = 1 + len(blocks) + step.kernel  # a window group's arrays
        batch.local = [self._local_batch(batch, rest[j * each : (j + 1) * each]) for j in range(self.local_groups)]
        return ids, pos, batch, sample_at

    @staticmethod
    def _local_batch(batch: PagedBatch, arrays: list[torch.Tensor]) -> PagedBatch:
        """A group of sliding-window layers' view of the step: `batch` with that group's slots and
        tables (kvcache/windowed_blocks.py); the masks, lengths and rows are the same."""
        slots, *blocks = arrays
        kernel = batch.kernel
        if kernel is not None:
            *blocks, table = blocks
            kernel = replace(kernel, tables=table)
        decodes = [replace(group, blocks=b) for group, b in zip(batch.decodes, blocks, strict=False)]
        prefills = [replace(seg, blocks=b) for seg, b in zip(batch.prefills, blocks[len(decodes) :], strict=True)]
        return PagedBatch(slots=slots, decodes=decodes, prefills=prefills, kernel=kernel)

    def _kernel_arrays(self, nd: int, spans: list[tuple[int, int, int]], tables: list[np.ndarray]) -> list[np.ndarray]:
        """For an in-place kernel: the decodes and continued prefill chunks as (tokens, tables, rows,
        context) arrays; [] when the step has only fresh prefills (SDPA's causal kernel runs them)."""
        continued = [(span, table) for span, table in zip(spans, tables, strict=True) if span[2] > 0]
        if nd == 0 and not continued:
            return []
        width = max([int(self._widths[:nd].max(initial=0))] + [len(table) for _, table in continued])
        table = self._kernel_table(nd, spans, tables, self._tables, width)
        tokens, rows, context = [np.arange(nd)], [np.arange(nd)], [self._lens[:nd]]
        for row, (start, n, p) in enumerate((span for span, _ in continued), start=nd):
            tokens.append(np.arange(start, start + n))
            rows.append(np.full(n, row))
            context.append(np.arange(p + 1, p + n + 1))
        return [np.concatenate(tokens), table, np.concatenate(rows), np.concatenate(context)]

    def _kernel_table(
        self, nd: int, spans: list[tuple[int, int, int]], tables: list[np.ndarray], decodes: np.ndarray, width: int
    ) -> np.ndarray:
        """The kernel's table rows: the decodes' (from `decodes`), then the continued chunks' `tables`."""
        continued = [table for span, table in zip(spans, tables, strict=True) if span[2] > 0]
        table = np.zeros((nd + len(continued), width), dtype=np.int64)
        table[:nd] = decodes[:nd, :width]
        for row, blocks in enumerate(continued, start=nd):
            table[row, : len(blocks)] = blocks
        return table

    def _decode_group(self, start: int, end: int, lens: torch.Tensor, blocks: torch.Tensor) -> DecodeGroup:
        """Rows start..end-1 (sorted by width): their block tables [n, width] and context mask."""
        keys = blocks.shape[1] * self.block_size
        beyond = self._key_pos[:keys][None, :] >= lens[start:end, None]
        # An additive float mask: SDPA's CPU kernel runs faster with it than with a boolean one.
        mask = torch.zeros(beyond.shape, dtype=self.cache.layout.dtype, device=self.device)
        mask.masked_fill_(beyond, -torch.inf)
        return DecodeGroup(start, end - start, blocks, mask.view(end - start, 1, 1, keys), lens[start:end])

    def _group_bounds(self, nd: int) -> list[tuple[int, int]]:
        """[start, end) row ranges: on CPU each group's gathered K/V within `group_bytes`;
        elsewhere up to MAX_DECODE_GROUPS groups of at least MIN_GROUP rows."""
        if nd == 0:
            return []
        if self.device.type != "cpu" or self.attention.name != "torch":
            count = max(1, min(MAX_DECODE_GROUPS, nd // MIN_GROUP))
            bounds = [round(nd * g / count) for g in range(count + 1)]
            return [(s, e) for s, e in zip(bounds, bounds[1:], strict=False) if e > s]
        layout = self.cache.layout
        per_block = 2 * self.block_size * layout.num_kv_heads * layout.head_dim * self.cache.k.element_size()
        widths, out, start = self._widths, [], 0
        while start < nd:
            end = start + 1  # rows are sorted by width, so a group's width is its last row's
            while end < nd and (end + 1 - start) * int(widths[end]) * per_block <= self.group_bytes:
                end += 1
            out.append((start, end))
            start = end
        return out

    def _segment(self, offset: int, n: int, start: int, blocks: torch.Tensor) -> PrefillSegment:
        if start == 0:
            return PrefillSegment(offset, n, 0, blocks)
        total = start + n
        keys = torch.arange(total, device=self.device)
        queries = torch.arange(start, total, device=self.device)
        return PrefillSegment(offset, n, start, blocks, keys[None, :] <= queries[:, None])

    @torch.inference_mode()
    def run(self, plan: StepPlan, ahead: InFlightTokens | None = None) -> torch.Tensor:
        """Runs one step; returns float32 logits [S, vocab] for the sampling chunks.

        `ahead`: the step still in flight, whose sampled tokens (on the device) are the inputs of
        this step's decodes that have them PENDING."""
        if self.graphs is not None and not plan.prefills:
            logits = self.graphs.run(plan.decodes, ahead)  # every decode samples, in plan order
            if logits is not None:
                return logits
        step = self.host_inputs(plan, ahead)
        if self.mirror is not None:
            self.mirror(step)  # NOTE: tensor parallelism: the other ranks run this step's forward too
        ids, positions, batch, sample_at = self.device_inputs(step, ahead)
        if self.lora_rows is not None:
            self.lora_rows.set(row_adapters(plan), self.device)
        embeds = media_rows(plan, self.device)
        extra = {"embeds": embeds} if embeds is not None else {}
        hidden = self.model(ids, positions, self.attention.bind(batch), **extra)
        if step.logprob_rows:
            self.prompt_logprobs(plan, hidden)
        self._verify_drafts(plan, hidden)
        return self.model.logits(hidden.index_select(0, sample_at), self.vocab_chunk)

    def _verify_drafts(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """For each chunk carrying proposals (speculate.py): the model's greedy choice at each of its
        positions, for the engine to keep the proposals it agrees with."""
        offset = len(plan.decodes)  # prefill chunks follow the decodes in the flat batch
        for chunk in plan.prefills:
            if chunk.seq.draft and chunk.samples:
                logits = self.model.logits(hidden[offset : offset + chunk.length], self.vocab_chunk)
                if chunk.seq.params.greedy:
                    chunk.seq.verify = greedy(logits).tolist()
                else:
                    chunk.seq.verify_logits = logits
            offset += chunk.length

    @torch.inference_mode()
    def replay(self, step: StepInputs) -> None:
        """Another rank's side of a tensor-parallel step: the forward and logits that `run` makes on
        rank 0, in the same order (their collectives pair up); no sampling, nothing returned."""
        ids, positions, batch, sample_at = self.device_inputs(step)
        hidden = self.model(ids, positions, self.attention.bind(batch))
        for start, n in step.logprob_rows:
            self.model.logits(hidden[start : start + n], self.vocab_chunk)
        self.model.logits(hidden.index_select(0, sample_at), self.vocab_chunk)

    def prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """For the prefill chunks whose requests ask (`prompt_logprobs`): each next prompt token's
        log-probability, rank and the best alternatives, from the same forward (teacher forcing).
        NOTE: the host waits for them (one copy per step that has such chunks)."""
        for chunk, offset, count in logprob_chunks(plan):
            seq, start = chunk.seq, chunk.start
            k = seq.params.prompt_logprobs
            assert k is not None
            stop = start + count
            rows = torch.arange(offset, offset + count, device=hidden.device)
            logp = torch.log_softmax(self.model.logits(hidden.index_select(0, rows), self.vocab_chunk), dim=-1)
            targets = torch.tensor(seq.tokens[start + 1 : stop + 1], device=hidden.device)[:, None]
            chosen = logp.gather(1, targets)
            ranks = (logp > chosen).sum(dim=-1) + 1
            values, ids = logp.topk(max(k, 1), dim=-1)
            if len(seq.prompt_logprobs) < seq.num_prompt:
                seq.prompt_logprobs = [None] * seq.num_prompt  # the first token has no context
            for j, (c, r, v, i) in enumerate(
                zip(chosen[:, 0].tolist(), ranks.tolist(), values.tolist(), ids.tolist(), strict=True)
            ):
                seq.prompt_logprobs[start + 1 + j] = (c, r, list(zip(i[:k], v[:k], strict=True)))
