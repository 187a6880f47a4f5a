"""Stage 6, write: Pending -> committed windows, in input order.

Waits on each result's d2h_done, scatters it into its window's buffer (dense rows), or keeps the
batch's items (a head's ragged items: `values.Ragged`, gathered in input order at the commit), and
commits a window as one atomic part (results + rejects) as soon as all its batches are in, windows
in order.

With `commit_every_s`, rows that landed in windows not yet complete are checkpointed (the
store's chunks: window-local row index, failed flag, values) once the oldest of them started
computing that long ago, so a kill loses at most about that much work. A resumed run's writer is
handed those rows back (`held`) and fills them in before its own batches land.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..device import OutputPool
from ..errors import DeviceResultFailed
from ..files.parts import PartStore
from ..job.rejects import RejectCounter
from ..obs.latency import LatencyLog
from ..types import Reject
from ..values import Ragged, RaggedSpec
from .fanout import gathered_meta, request_firsts, whole_requests
from .held import Held, checkpoint_table, window_facts
from .types import Pending, Window


class DenseRows:
    """A window's dense rows: one float32 [rows, dim] buffer, filled in as batches land."""

    def __init__(self, rows: int, dim: int) -> None:
        self.values = np.empty((rows, dim), np.float32)

    def put(self, rows: np.ndarray, values: np.ndarray) -> None:
        self.values[rows] = values

    def take(self, rows: np.ndarray, consume: bool = False) -> np.ndarray:
        return self.values[rows]


class RaggedRows:
    """A window's ragged rows: each landed batch's items as they came, gathered by window row on demand."""

    def __init__(self, rows: int, spec: RaggedSpec) -> None:
        self.rows, self.spec = rows, spec
        self.pieces: list[tuple[np.ndarray, Ragged]] = []

    def put(self, rows: np.ndarray, values: Ragged) -> None:
        self.pieces.append((np.asarray(rows, np.int64), values))

    def take(self, rows: np.ndarray, consume: bool = False) -> Ragged:
        """The items of window rows `rows` (distinct, every one landed), in that order: each field's
        items copied once, straight from the batch they landed in to their place. `consume` (the
        commit) lets each batch go as soon as it is copied: the window is never held twice."""
        where = np.full(self.rows, -1, np.int64)  # window row -> its place in the answer
        where[rows] = np.arange(len(rows))
        counts = np.zeros(len(rows), np.int64)
        for landed, piece in self.pieces:
            wanted = where[landed] >= 0
            counts[where[landed[wanted]]] = np.asarray(piece.counts)[wanted]
        out = self.spec.empty(len(rows))
        out.counts = counts
        starts = out.offsets()[:-1]
        total = int(counts.sum())
        fields = {f.name: np.empty((total, *f.shape), f.dtype) for f in self.spec.fields}
        found = 0
        pieces = self.pieces
        if consume:
            pieces, self.pieces = _draining(self.pieces), []
        for landed, piece in pieces:
            wanted = where[landed] >= 0
            if not wanted.any():
                continue
            part = piece if wanted.all() else piece[wanted]
            n = np.asarray(part.counts, np.int64)
            within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
            into = np.repeat(starts[where[landed[wanted]]], n) + within
            for name, values in fields.items():
                values[into] = part.fields[name]
            found += int(wanted.sum())
        assert found == len(rows), "rows asked for that never landed"
        out.fields = fields
        return out


def _draining(items: list) -> Iterator:
    """`items` one by one, each dropped from the list as it is handed out (so it can be freed)."""
    items.reverse()
    while items:
        yield items.pop()


@dataclass(slots=True)
class _WindowState:
    window: Window
    values: DenseRows | RaggedRows
    held: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # window rows taken from a checkpoint
    failed: list[int] = field(default_factory=list)  # window rows that could not run
    batches_done: int = 0
    fresh: list[np.ndarray] = field(default_factory=list)  # window rows landed since the last checkpoint
    fresh_since_ns: int | None = None  # when the oldest of their batches started computing


class Writer:
    """Consumes Pending; a sink: produces nothing, commits windows in window order."""

    name = "write"

    def __init__(
        self,
        store: PartStore,
        outputs: OutputPool | list[OutputPool],
        rejects: RejectCounter,
        first_window: int = 0,
        on_batch: Callable[[Pending], None] | None = None,
        latency: LatencyLog | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
        *,
        commit_every_s: float = 0.0,
        held: dict[int, Held] | None = None,
    ) -> None:
        self.store = store
        self.dim = store.dim
        self.ragged: RaggedSpec | None = store.ragged  # a head's ragged items, or None: dense rows
        self.outputs = outputs if isinstance(outputs, list) else [outputs]  # one pool per device
        self.rejects = rejects
        self.on_batch = on_batch
        self.latency = latency
        self.clock = clock
        self._open: dict[int, _WindowState] = {}
        self._next_window = first_window
        self.rows_written = 0
        self.written_by_source: dict[str, int] = {}  # input file -> rows written by this run
        self.commit_every_ns = int(commit_every_s * 1e9)  # 0: no checkpoints
        self.held = held if held is not None else {}  # NOTE: the planner's own: shared, see Planner
        self.rows_held = 0  # rows taken from an interrupted run's checkpoints (and written again)
        self.held_by_source: dict[str, int] = {}  # input file -> of those, resumed, not written by this run
        self.checkpoints = 0
        self._last_checkpoint_ns = 0

    def process(self, pending: Pending) -> Iterator[None]:
        batch, out = pending.batch, pending.out
        w = batch.window
        state = self._open.get(w.window_id)
        if state is None:
            state = self._open[w.window_id] = self._open_window(w)
        if out is not None:
            self.wait_result(pending)
            state.values.put(batch.rows, self._landed(out, batch.num_rows))
            state.failed.extend(int(batch.rows[i]) for i in pending.failed_rows)
            if self.latency is not None:
                self.latency.batch_done(batch.started_ns, self.clock())
            if self.commit_every_ns and batch.num_rows:
                state.fresh.append(batch.rows)
                started = batch.started_ns or self.clock()
                since = state.fresh_since_ns
                state.fresh_since_ns = started if since is None else min(since, started)
        state.batches_done += 1
        if self.on_batch is not None:
            self.on_batch(pending)
        if out is not None:
            # NOTE: only now, once on_batch has read the device times from the buffer's events: the
            # executor replaces them as soon as it takes the buffer again.
            self.outputs[pending.replica].release(out)
        self._commit_ready()
        if self.commit_every_ns and self._checkpoint_due():
            self.checkpoint()
        return iter(())

    def _landed(self, out: Any, rows: int) -> np.ndarray | Ragged:
        """A batch's results as the window keeps them (copied: the buffer goes back to the executor)."""
        if self.ragged is None:
            return out.host[:rows].numpy()
        if out.items is None:  # NOTE: no row of the batch could run: none has an item
            return self.ragged.empty(rows)
        counts = out.views["counts"][:rows].numpy().copy()
        fields = {f.name: out.views[f.name].numpy().copy() for f in self.ragged.fields}
        return Ragged(counts, fields)

    def _open_window(self, w: Window) -> _WindowState:
        """A window's buffer; a resumed window's held rows are filled in (they are not computed again)."""
        values = DenseRows(len(w), self.dim) if self.ragged is None else RaggedRows(len(w), self.ragged)
        state = _WindowState(w, values)
        held = self.held.pop(w.window_id, None)
        if held is not None and held.fits(w.first_row, w.input_rows):
            state.values.put(held.rows, held.values)
            state.failed.extend(held.rows[held.failed].tolist())
            state.held = held.rows[~held.failed]
            self.rows_held += len(state.held)
        return state

    def _checkpoint_due(self) -> bool:
        """The oldest uncheckpointed work started `commit_every` ago (and not before the last checkpoint)."""
        starts = [s.fresh_since_ns for s in self._open.values() if s.fresh_since_ns is not None]
        if not starts:
            return False
        return self.clock() - max(min(starts), self._last_checkpoint_ns) >= self.commit_every_ns

    def checkpoint(self) -> None:
        """Keeps the rows landed in open windows since the last checkpoint (the store's chunks)."""
        chunks = []
        for window_id, state in sorted(self._open.items()):
            if not state.fresh:
                continue
            rows = np.sort(np.concatenate(state.fresh))
            failed = np.isin(rows, np.asarray(state.failed, dtype=np.int64))
            table = checkpoint_table(rows, state.values.take(rows), failed)
            w = state.window
            chunks.append((window_id, table, window_facts(w.first_row, w.input_rows, w.cut_tokens)))
            state.fresh, state.fresh_since_ns = [], None
        if chunks:
            self.store.checkpoint(chunks)
            self.checkpoints += 1
        self._last_checkpoint_ns = self.clock()

    @staticmethod
    def wait_result(pending: Pending) -> None:
        try:
            pending.out.events["d2h_done"].synchronize()
        except Exception as exc:  # NOTE: the device's own failure, surfacing in this stage
            raise DeviceResultFailed(pending.replica, exc) from exc

    def _commit_ready(self) -> None:
        while (state := self._open.get(self._next_window)) and state.batches_done == state.window.num_batches:
            self._commit(state)
            del self._open[self._next_window]
            self._next_window += 1

    def _commit(self, state: _WindowState) -> None:
        w = state.window
        keep = np.ones(len(w), dtype=bool)
        # NOTE: a failed part rejects its whole request (fanout.py); plain rows are their own request
        first, drop = whole_requests(self._dimension_problems(w), w.rows, w.options, name_parts=False)
        oom = {i: ("oom", "does not fit in device memory even alone") for i in state.failed if i not in drop}
        more, more_drop = whole_requests(oom, w.rows, w.options)
        first, drop = first | more, drop | more_drop
        keep[list(drop)] = False
        late = [self._reject(w, i, reason, message) for i, (reason, message) in sorted(first.items())]
        self.rejects.add(late)
        rejects = sorted(w.rejects + late, key=lambda r: r.row)
        meta = None
        if w.options is not None:  # requests (OpenAI-style): one output row each, gathered from its parts
            meta = gathered_meta(w.options, w.rows, np.diff(w.offsets), keep)
            answered = request_firsts(w.options, keep)
        else:
            answered = np.flatnonzero(keep)
        ids = [w.ids[i] for i in answered.tolist()] if late or w.options is not None else w.ids
        rows = [r.to_json() for r in rejects]
        kept = np.flatnonzero(keep)
        values = state.values.take(kept, consume=True)
        self.store.commit(w.window_id, w.first_row, w.input_rows, ids, values, rows, meta)
        self.rows_written += len(ids)
        resumed = self._resumed(state, answered)
        for rows, books in ((answered[~resumed], self.written_by_source), (answered[resumed], self.held_by_source)):
            blocks, counts = np.unique(w.block_ids[rows], return_counts=True)
            for block, count in zip(blocks.tolist(), counts.tolist(), strict=True):
                source = w.sources[block]
                books[source] = books.get(source, 0) + count
        if self.latency is not None and w.arrival_ns is not None:
            self.latency.requests_done(w.arrival_ns[answered], self.clock())
        self.rejects.check_fraction(self.store.rows_committed)

    @staticmethod
    def _resumed(state: _WindowState, answered: np.ndarray) -> np.ndarray:
        """Of the rows written (a request: its first part's row), those a checkpoint held (a request:
        every part of it): resumed, not written by this run."""
        held = np.zeros(len(state.window), bool)
        held[state.held] = True
        options = state.window.options
        if options is None:
            return held[answered]
        return np.array([held[i : i + options[i].count].all() for i in answered.tolist()], bool)

    @staticmethod
    def _reject(w: Window, i: int, reason: str, message: str) -> Reject:
        block, row = int(w.block_ids[i]), int(w.rows[i])
        source = w.sources.get(block, "")
        return Reject(row, source, None, w.ids[i], reason, message, row - w.file_first_rows.get(block, 0))

    def _dimension_problems(self, w: Window) -> dict[int, tuple[str, str]]:
        """OpenAI requests asking for more dimensions than the model has: {window row: problem}."""
        out = {}
        for i, part in enumerate(w.options or []):
            dims = getattr(part.request, "dimensions", None)
            if dims is not None and dims > self.dim:
                out[i] = ("invalid_dimensions", f"dimensions {dims} is more than the model's {self.dim}")
        return out

    def finish(self) -> Iterator[None]:
        assert not self._open, "every window must be complete at the end"
        return iter(())
