"""Graphs for the forward: every (rows bucket, padded width) of the plan captured up front, replayed after.

A batch of n rows at width w replays the graph of the smallest rows bucket >= n at w; padding rows
get length 1 and their outputs are dropped. The rules this follows, each of which the simulated
device enforces:

- All graphs are captured in the constructor, before any stage thread starts: during a capture
  (global mode) no other thread may synchronize or query an event, and the stage and writer
  threads do that all the time.
- Buckets keep the token budget: at width w, the powers of two below cap(w) = min(max_rows,
  max_tokens // w), and cap(w) itself, so a padded batch never holds more than max_tokens tokens;
  a bucket above the running budget (lowered after an out-of-memory split) is not used: the batch
  runs eagerly instead.
- Each compute stream has its own graphs, static input and output buffers, and one memory pool
  shared by all of them: one stream's graphs replay one after another, so their intermediates may
  share memory; graphs of two streams replay concurrently, so they may not. For the same reason
  each stream's graphs are warmed up and captured on a capture stream of their own (a lane), so
  they never share a cuBLAS workspace with another stream's. `close` frees it all.
- The result handed back is a copy: the graph's static output is overwritten by its next replay,
  and an out-of-memory split replays one graph twice before either half is copied to the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .base import Device, Graph

Forward = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


def row_buckets(width: int, max_tokens: int, max_rows: int) -> list[int]:
    """Ascending rows buckets at `width`: powers of two below the cap, then the cap."""
    cap = max(1, min(max_rows, max_tokens // width))
    buckets = [1 << k for k in range(cap.bit_length()) if 1 << k < cap]
    return [*buckets, cap]


def graph_widths(max_width: int, pad_multiple: int) -> list[int]:
    """Every padded width the planner can cut: multiples of pad_multiple, and the clamped maximum."""
    return sorted({*range(pad_multiple, max_width, pad_multiple), max_width})


class _StreamGraphs:
    """One compute stream's graphs over the whole grid: static inputs and output shared by all, one pool.

    NOTE: every graph writes its rows into the one static output, so a graph's own result is an
    intermediate, freed at the end of its capture and reusable by the next: the pool holds about one
    largest batch's activations, not the sum over a few hundred graphs.
    """

    def __init__(
        self, device: Device, forward: Forward, grid: dict[int, list[int]], max_tokens: int, lane: int
    ) -> None:
        max_rows = max(rows[-1] for rows in grid.values())
        self.forward = forward
        self.pool = device.graph_pool()
        self.ids = device.device_buffer((max_tokens,), torch.int32)  # every graph reads a prefix: [rows, width]
        self.lengths = device.device_buffer((max_rows,), torch.int32)
        self.lengths.fill_(1)  # NOTE: never 0: a row with no token attends to nothing (NaN)
        dim = forward(self.view(1, min(grid)), self.lengths[:1], True).shape[1]
        self.out = device.device_buffer((max_rows, dim), torch.float32)
        self.graphs: dict[tuple[int, int], Graph] = {}
        for width, buckets in grid.items():
            device.warm_up(lambda w=width, r=buckets[-1]: self.run(r, w), lane)
            for rows in buckets:
                graph, _ = device.capture(lambda w=width, r=rows: self.run(r, w), self.pool, lane)
                self.graphs[(rows, width)] = graph

    def view(self, rows: int, width: int) -> torch.Tensor:
        return self.ids[: rows * width].view(rows, width)

    def run(self, rows: int, width: int) -> torch.Tensor:
        """The captured work: forward over the static inputs, into the static output. [rows, dim]"""
        out = self.out[:rows]
        out.copy_(self.forward(self.view(rows, width), self.lengths[:rows], True))
        return out


class GraphRunner:
    """In place of the model call: same inputs, same [rows, dim] output, or None for a shape it has no graph for."""

    def __init__(
        self,
        device: Device,
        forward: Forward,
        *,
        max_tokens: int,
        max_rows: int,
        max_width: int,
        pad_multiple: int,
        budget_tokens: Callable[[], int] | None = None,
    ) -> None:
        self.device = device
        self.budget_tokens = budget_tokens or (lambda: max_tokens)  # the running budget, lowered after OOM
        self.grid = {w: row_buckets(w, max_tokens, max_rows) for w in graph_widths(max_width, pad_multiple)}
        device.bind_thread()
        self._streams = [
            _StreamGraphs(device, forward, self.grid, max_tokens, stream.index) for stream in device.compute_streams
        ]
        self.graphs_captured = self.captured
        self._lock = threading.Lock()  # compute streams count from their own threads (simulated)
        self.replays = 0
        self.eager = 0  # calls without a graph: the caller ran the model itself

    @property
    def captured(self) -> int:
        """Graphs held now (0 once closed)."""
        return sum(len(s.graphs) for s in self._streams)

    @property
    def pools(self) -> list[object]:
        return [s.pool for s in self._streams]

    def padded_rows(self, n: int, width: int) -> int | None:
        """The rows bucket a batch of n rows at `width` replays, or None when it must run eagerly."""
        for rows in self.grid.get(width, ()):
            if rows >= n:
                return rows if rows * width <= self.budget_tokens() else None
        return None

    def __call__(self, stream_index: int, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Replays on the current stream (call it inside Stream.launch); ids [n, width], lengths [n]."""
        n, width = ids.shape
        rows = self.padded_rows(n, width)
        if rows is None or not self._streams:
            with self._lock:
                self.eager += 1
            return None
        mine = self._streams[stream_index]
        graph = mine.graphs[(rows, width)]
        static_ids, static_lengths = mine.view(rows, width), mine.lengths[:rows]
        static_ids[:n].copy_(ids)
        static_lengths[:n].copy_(lengths)
        if n < rows:
            static_ids[n:].zero_()
            static_lengths[n:].fill_(1)
        graph.replay()
        with self._lock:
            self.replays += 1
        return mine.out[:n].clone()  # NOTE: the caller's own rows; the next replay overwrites the static output

    def close(self) -> None:
        """Frees every graph and its pool once the work already issued has finished."""
        self.device.synchronize()
        self._streams = []
        self.device.release_cached_memory()
