"""Stage 5, execute: Staged -> Pending. Forward on one of K compute streams, D2H into a host buffer.

Each compute stream waits on the batch's h2d_done; the staging slot goes back to the ring as soon
as the forward is issued (the next copy into it waits on compute_done on the device); the result
is guarded by d2h_done, which the writer waits on.

Out of memory: the batch is split in half and each half retried, down to single rows (a row that
still fails is reported as failed, and becomes a reject); the running token budget is lowered so
later windows are cut smaller. With graphs, what ran (and failed) is the padded rows bucket, so that
is what the budget counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from ..device import Device, OutputPool, StagingRing
from ..device.base import OutputBuffer, is_out_of_memory
from ..device.graphs import GraphRunner
from ..models.adapter import BatchModel
from ..values import Ragged
from .plan import TokenBudget
from .types import Pending, Staged


class Executor:
    name = "execute"

    def __init__(
        self,
        device: Device,
        model: BatchModel,
        ring: StagingRing,
        outputs: OutputPool,
        graphs: GraphRunner | None = None,
        budget: TokenBudget | None = None,
        batch_profiler: Any = None,
        replica: int = 0,
    ) -> None:
        self.replica = replica  # the index of this executor's device among several
        self.batch_profiler = batch_profiler  # torch.profiler driven from this thread (hpcinfer profile)
        self.device = device
        self.model = model
        self.graphs = graphs  # graph replay in place of the eager forward, when enabled
        self.ring = ring
        self.outputs = outputs
        self.budget = budget
        self._streams = device.compute_streams
        self.waited_ns = 0  # time blocked on a free output buffer: back-pressure, not work

    def process(self, staged: Staged) -> Iterator[Pending]:
        batch, slot = staged.batch, staged.slot
        if self.batch_profiler is not None:
            self.batch_profiler.on_batch()
        if slot is None:  # an empty batch carries a window of rejects only
            yield Pending(batch, None, replica=self.replica)
            return
        n, width = batch.num_rows, batch.padded_len
        stream = self._streams[batch.batch_id % len(self._streams)]
        t0 = time.perf_counter_ns()
        out = self.outputs.acquire()  # blocks while the writer holds every output buffer
        self.waited_ns += time.perf_counter_ns() - t0
        pending = Pending(batch, out, stream.index, replica=self.replica)
        ids_all = slot.dev_ids[: n * width].view(n, width)
        lengths_all = slot.dev_lengths[:n]
        host_lengths = batch.lengths

        pieces: list[tuple[int, int, Any]] = []  # (lo, hi, result rows: a tensor or Ragged) on the device

        def run_rows(lo: int, hi: int) -> None:
            """Forward rows [lo, hi) of the batch, halving on out-of-memory."""
            rows = hi - lo  # the rows that really run: a graph pads them up to its bucket
            if self.graphs is not None:
                rows = self.graphs.padded_rows(rows, width) or rows
            try:
                self.device.before_forward(rows, width)
                ids, lengths = ids_all[lo:hi], lengths_all[lo:hi]
                y = self.graphs(stream.index, ids, lengths) if self.graphs is not None else None
                if y is None:
                    y = self.model(ids, lengths, bool(host_lengths[lo:hi].min() < width))
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                if self.budget is not None:
                    self.budget.lower(rows * width)  # NOTE: padded tokens, as the budget counts them
                if hi - lo == 1:
                    pending.failed_rows.append(lo)
                    return
                pending.splits[0] += 1
                mid = (lo + hi) // 2
                run_rows(lo, mid)
                run_rows(mid, hi)
                return
            pieces.append((lo, hi, y))

        def d2h() -> None:
            if pieces and isinstance(pieces[0][2], Ragged):
                ragged_to_host(out, n, pieces)
            else:
                for lo, hi, y in pieces:
                    out.host[lo:hi].copy_(y, non_blocking=True)
            pieces.clear()

        stream.wait(staged.h2d_done)
        start = stream.record()
        stream.launch(lambda: run_rows(0, n))
        slot.compute_done = stream.record()
        self.ring.release(slot)
        stream.launch(d2h)
        out.events = {
            "h2d_start": staged.h2d_start,
            "h2d_done": staged.h2d_done,
            "compute_start": start,
            "compute_done": slot.compute_done,
            "d2h_done": stream.record(),
        }
        yield pending

    def finish(self) -> Iterator[Pending]:
        if self.batch_profiler is not None:
            self.batch_profiler.close()
        if self.graphs is not None:
            self.graphs.close()  # the graphs' memory goes back as soon as the last batch is issued
        return iter(())


def ragged_to_host(out: OutputBuffer, rows: int, pieces: list[tuple[int, int, Ragged]]) -> None:
    """A batch's ragged items into `out`'s arenas: each row's item count (0 for a row that could not
    run) and each field's items, the pieces' rows in order (issued on the batch's compute stream).

    NOTE: an item count a head knows only from its data (SPLADE's non-zero entries) is a tensor
    shape read here: on CUDA, reading it waits for that batch's forward.
    """
    counts = out.arena("counts", (rows,), torch.int64)
    counts.zero_()
    names = list(pieces[0][2].fields)
    sizes = [int(y.fields[names[0]].shape[0]) for _, _, y in pieces]
    total = sum(sizes)
    arenas = {}
    for name in names:
        first = pieces[0][2].fields[name]
        arenas[name] = out.arena(name, (total, *first.shape[1:]), first.dtype)
    at = 0
    for (lo, hi, y), size in zip(pieces, sizes, strict=True):
        counts[lo:hi].copy_(y.counts, non_blocking=True)
        for name in names:
            arenas[name][at : at + size].copy_(y.fields[name], non_blocking=True)
        at += size
    out.items = total
