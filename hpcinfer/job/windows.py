"""The window book: a run's open windows of input rows, from the first row read to the commit.

A window is `window_rows` consecutive input rows. It opens when its first row is read (closing the
one before: rows are read in order), counts each row booked to it (`input_rows`), each admitted
and not yet finished (`pending`), and keeps what finished (`results`, by input row) and what was
rejected. A window is complete once it is closed and nothing is pending; `complete()` hands the
complete ones back in window order, which is the ordered commit. With checkpoints on, it also
keeps the results finished since the last checkpoint (`fresh`) and when the oldest of them started.

One book serves every place rows are windowed for an engine: the local job (which commits), a
Ray replica (a unit is one window) and a tuning pass (which keeps no results).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..types import Reject


@dataclass(slots=True)
class OpenWindow:
    window_id: int
    first_row: int  # its first input row this run reads (after rows a resumed run skips)
    input_rows: int = 0
    pending: int = 0  # admitted, not finished
    closed: bool = False  # every input row of the window is read
    results: list[tuple[int, Any]] = field(default_factory=list)  # (input row, result), in finishing order
    rejects: list[Reject] = field(default_factory=list)
    fresh: list[tuple[int, Any]] = field(default_factory=list)  # results since the last checkpoint
    fresh_since: float | None = None  # when the oldest of them started (perf_counter seconds)

    @property
    def complete(self) -> bool:
        return self.closed and self.pending == 0


class WindowBook:
    """Opens, books and hands back a run's windows in order (see the module)."""

    def __init__(
        self,
        window_rows: int,
        *,
        keep_results: bool = True,
        track_fresh: bool = False,
        on_reject: Callable[[Reject], None] | None = None,
    ) -> None:
        self.window_rows = window_rows
        self.keep_results = keep_results  # False: count only (a tuning pass)
        self.track_fresh = track_fresh  # True: keep what a checkpoint takes (--commit-every)
        self.on_reject = on_reject
        self.open: deque[OpenWindow] = deque()

    def window_for(self, row: int) -> OpenWindow:
        """The window of input row `row`, opened (and the one before closed) at its first row read."""
        wid = row // self.window_rows
        if not self.open or self.open[-1].window_id != wid:
            if self.open:
                self.open[-1].closed = True
            self.open.append(OpenWindow(wid, max(row, wid * self.window_rows)))
        return self.open[-1]

    def close(self) -> None:
        """Every input row of the newest window is read."""
        if self.open:
            self.open[-1].closed = True

    def reject(self, window: OpenWindow, item: Reject) -> None:
        window.rejects.append(item)
        if self.on_reject is not None:
            self.on_reject(item)

    def fail(self, window: OpenWindow, item: Reject) -> None:
        """An admitted row that could not run after all: a reject, no longer pending."""
        window.pending -= 1
        self.reject(window, item)

    def answered(self, window: OpenWindow, row: int, result: Any) -> None:
        """A row answered without running (an interrupted run's checkpoint held it)."""
        window.results.append((row, result))

    def finish(self, window: OpenWindow, row: int, result: Any, started: float | None = None) -> None:
        """An admitted row finished; `started` (perf_counter seconds): when its work began."""
        window.pending -= 1
        if not self.keep_results:
            return
        window.results.append((row, result))
        if self.track_fresh:
            window.fresh.append((row, result))
            if started is not None:
                since = window.fresh_since
                window.fresh_since = started if since is None else min(since, started)

    def complete(self) -> Iterator[OpenWindow]:
        """The complete windows at the front, oldest first, each taken out of the book."""
        while self.open and self.open[0].complete:
            yield self.open.popleft()

    def oldest_fresh(self) -> float | None:
        """When the oldest result not yet checkpointed started; None when there is none."""
        starts = [w.fresh_since for w in self.open if w.fresh_since is not None]
        return min(starts) if starts else None

    def take_fresh(self) -> list[OpenWindow]:
        """The windows holding fresh results, as they are now; their fresh lists start again empty."""
        taken = [replace_fresh(w) for w in self.open if w.fresh]
        for w in self.open:
            w.fresh, w.fresh_since = [], None
        return taken


def replace_fresh(window: OpenWindow) -> OpenWindow:
    """A snapshot of `window` whose `fresh` list is its own (the book's starts again)."""
    return OpenWindow(window.window_id, window.first_row, fresh=list(window.fresh))
