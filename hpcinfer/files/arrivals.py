"""Arrival-rate replay (`--rate QPS`): releases requests on an open-loop Poisson schedule.

Emulates an online service on a file of requests: request k arrives at t0 + the sum of k
exponential gaps (mean 1/rate, seeded), whatever the pipeline is doing. The source sleeps until
the next arrival and then releases every request that has arrived by now, so a pipeline that
cannot keep up releases ever larger blocks, and the time they spent queued counts in their
latency (open loop: a slow server does not slow the clients down).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from ..types import RowBlock


def poisson_gaps_ns(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """n inter-arrival gaps of a Poisson process of `rate` per second, in integer nanoseconds."""
    return np.round(rng.exponential(1e9 / rate, size=n)).astype(np.int64)


def slice_block(block: RowBlock, i: int, j: int, block_id: int) -> RowBlock:
    """The valid rows i..j-1 of a block, with the rejects that lie among them, as a block of its own.

    The slices of one block cover its input rows exactly once: the first slice starts at the
    block's first input row, the last ends at its end, so rejects ride with the next valid row.
    """
    n = len(block)
    start = block.first_row if i == 0 else block.rows[i]
    end = block.first_row + block.input_rows if j == n else block.rows[j]
    part = RowBlock(
        block_id,
        start,
        end - start,
        block.source,
        block.ids[i:j],
        rejects=[r for r in block.rejects if start <= r.row < end],
        rows=block.rows[i:j],
        lines=block.lines[i:j],
        arrival_ns=None if block.arrival_ns is None else block.arrival_ns[i:j],
        file_first_row=block.file_first_row,
    )
    if block.texts is not None:
        part.texts = block.texts[i:j]
    if block.prompts is not None:
        part.prompts = block.prompts[i:j]
    if block.options is not None:
        part.options = block.options[i:j]
    if block.token_ids is not None:
        flat, lengths = block.token_ids
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        part.token_ids = (flat[offsets[i] : offsets[j]], lengths[i:j])
    return part


class ArrivalReplay:
    """A source: the reader's blocks, released row by row at their Poisson arrival times."""

    name = "read"

    def __init__(
        self,
        blocks: Callable[[], Iterator[RowBlock]],
        rate: float,
        seed: int = 0,
        *,
        stop: threading.Event | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
        wait: Callable[[float], object] | None = None,
    ) -> None:
        self._blocks = blocks
        self.rate = rate
        self._rng = np.random.default_rng(seed)
        self._stop = stop or threading.Event()
        self._clock = clock
        self._wait = wait or self._stop.wait  # returns early once the run is stopping
        self._next_id = 0
        self.waited_ns = 0  # time asleep until the next arrival: idle, not work
        self.first_arrival_ns: int | None = None
        self.max_lag_ns = 0  # longest a request waited to be released (the pipeline was behind)

    def produce(self) -> Iterator[RowBlock]:
        last: int | None = None  # arrival time of the previous request
        for block in self._blocks():
            n = len(block)
            if not n:  # only rejects: nothing to wait for
                yield self._emit(block, 0, 0)
                continue
            gaps = poisson_gaps_ns(self._rng, self.rate, n)
            gaps[1:][np.diff(block.rows) == 0] = 0  # NOTE: a request's parts (one input row) arrive together
            if last is None:  # the first request arrives as soon as the first block is read
                last = self.first_arrival_ns = self._clock()
                gaps[0] = 0
            arrivals = last + np.cumsum(gaps)
            last = int(arrivals[-1])
            block.arrival_ns = arrivals
            i = 0
            while i < n:
                self._sleep_until(int(arrivals[i]))
                now = self._clock()
                j = max(i + 1, int(np.searchsorted(arrivals, now, side="right")))
                while j < n and block.rows[j] == block.rows[j - 1]:
                    j += 1  # never a part of a request without the rest
                self.max_lag_ns = max(self.max_lag_ns, now - int(arrivals[i]))
                yield self._emit(block, i, j)
                i = j

    def _sleep_until(self, t_ns: int) -> None:
        t0 = self._clock()
        while (remaining := t_ns - self._clock()) > 0 and not self._stop.is_set():
            self._wait(remaining / 1e9)
        self.waited_ns += self._clock() - t0

    def _emit(self, block: RowBlock, i: int, j: int) -> RowBlock:
        whole = i == 0 and j == len(block)
        part = block if whole else slice_block(block, i, j, 0)
        part.block_id = self._next_id
        self._next_id += 1
        return part
