"""Rows into the engine's queue: a window at a time in prefix and priority order, or as they arrive.

Without `--rate` a window of `--window-rows` rows is read whole and handed to the engine sorted by
token ids (`prefix_order`; `--no-prefix-order` keeps file order), highest priority first, a few
at a time so the engine's queue stays short. Under `--rate` each row joins the queue at its
Poisson arrival time (`arrivals.poisson_gaps_ns`) and the queue orders it by priority; a window is
not reordered then (its rows are not all there to sort). A row's latency starts when it was read,
or when it arrived.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from ...files.arrivals import poisson_gaps_ns
from ...job.windows import WindowBook
from ...types import Reject
from ..sequence import SamplingParams


class PromptRow(Protocol):
    """What admission reads of a row that will run (tasks/generate/requests.py's `Request` is one)."""

    row: int  # global input row number
    tokens: list[int]
    params: SamplingParams
    priority: int
    read_s: float  # when it was read, or arrived (perf_counter): the start of its latency


def prefix_order(requests: list[PromptRow]) -> list[PromptRow]:
    """A window's requests sorted by token ids: rows sharing a prefix become neighbours.

    NOTE: lexicographic order is the depth-first walk of the prompts' trie, so every shared
    prefix is one contiguous run; admitted in this order, the first row of a run computes the
    prefix and the rest find it cached. Ties keep input order (the sort is stable).
    """
    return sorted(requests, key=lambda r: r.tokens)


class Sink(Protocol):
    """Where admitted prompts go: one engine (`loop.EngineSink`) or one per device (`devices.EnginePool`)."""

    @property
    def queued(self) -> int:
        """Prompts handed over and not yet admitted into a batch."""
        ...

    def add(
        self, tokens: list[int], params: SamplingParams, tag: Any = None, seq_id: int | None = None, priority: int = 0
    ) -> Any: ...


class Admission:
    """Feeds a sink (an engine, or several) from `source`; rows and rejects are booked in `book`.

    `held(window, request)`, on a resumed run, books a row an interrupted run's checkpoint answered
    and says so (True: it is not run again).
    """

    def __init__(
        self,
        book: WindowBook,
        max_queued: int,
        prefix_ordered: bool,
        rate: float | None,
        rate_seed: int,
        *,
        held: Callable[[Any, PromptRow], bool] | None = None,
    ) -> None:
        self.book = book
        self.window_rows = book.window_rows
        self.max_queued = max_queued
        self.prefix_ordered = prefix_ordered
        self.rate = rate
        self.window_for, self.close, self.reject = book.window_for, book.close, book.reject
        self.held = held
        self._ready: deque[tuple[Any, PromptRow]] = deque()  # read, ordered, not yet in the engine
        self._next: PromptRow | Reject | None = None  # read ahead: the first row of the next window
        self._rng = np.random.default_rng(rate_seed)
        self.next_at: float | None = None  # --rate: when `_next` arrives (perf_counter seconds)

    def feed(self, source: Iterator[PromptRow | Reject], sink: Sink) -> bool:
        """Queues prompts until the sink has a queue to admit from; False once the input is exhausted."""
        if self.rate is not None:
            return self._feed_arrived(source, sink)
        more = True
        while sink.queued < self.max_queued:
            if not self._ready:
                more = self._read_window(source)
                if not self._ready:
                    return more
            window, item = self._ready.popleft()
            sink.add(item.tokens, item.params, tag=(window, item), seq_id=item.row, priority=item.priority)
        return more or bool(self._ready)

    def _book(self, window: Any, item: PromptRow | Reject) -> bool:
        """Counts `item` in its window; True for a request that will run, False for a reject or a held row."""
        window.input_rows += 1
        if isinstance(item, Reject):
            self.reject(window, item)
            return False
        if self.held is not None and self.held(window, item):
            return False
        window.pending += 1
        return True

    def _feed_arrived(self, source: Iterator[PromptRow | Reject], sink: Sink) -> bool:
        now = time.perf_counter()
        while True:
            if self._next is None:
                self._next = next(source, None)
                if self._next is None:
                    self.close()
                    return False
                gap = float(poisson_gaps_ns(self._rng, self.rate or 1.0, 1)[0]) / 1e9
                self.next_at = now if self.next_at is None else self.next_at + gap
            arrived_at = self.next_at if self.next_at is not None else now
            if arrived_at > now:
                return True
            item, self._next = self._next, None
            window = self.window_for(item.row)
            if self._book(window, item):
                item.read_s = arrived_at
                sink.add(item.tokens, item.params, tag=(window, item), seq_id=item.row, priority=item.priority)

    def _read_window(self, source: Iterator[PromptRow | Reject]) -> bool:
        """Reads the rest of one window into `_ready`, ordered; False once the input is exhausted."""
        requests: list[PromptRow] = []
        window: Any = None
        while True:
            item, self._next = self._next or next(source, None), None
            if item is None or (window is not None and item.row // self.window_rows != window.window_id):
                self._next = item
                self.close()  # every row of the window is read
                break
            window = self.window_for(item.row)
            if self._book(window, item):
                item.read_s = time.perf_counter()
                requests.append(item)
        if self.prefix_ordered:
            requests = prefix_order(requests)
        # NOTE: the engine's queue is kept short, so the window is handed over highest priority
        # first too (stable: prefix or file order within a class); the scheduler keeps it so.
        requests.sort(key=lambda r: -r.priority)
        self._ready.extend((window, r) for r in requests)
        return self._next is not None
