"""The engine loop, written once: feed admitted prompts, step, hand finished sequences on.

    admission.feed(source, sink) -> sink.collect(wait) -> on_finished(seq, device) -> after()

A sink is one engine driven right here (`EngineSink`: each `collect` runs one step), or one engine
per device on threads of their own (`devices.EnginePool`: `collect` takes what they finished).
The local job, a Ray replica and a tune trial all run this loop; they differ only in what they do
with a finished sequence (`on_finished`) and between steps (`after`: commit ready windows, show
progress).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ...device.threads import ThreadGovernor
from ...obs.profile import RangeBackend
from ...types import Reject
from ..engine import Engine
from ..sequence import Sequence
from .admission import Admission, PromptRow, Sink

IDLE_WAIT_S = 0.05  # the longest a loop waits for finished work before it feeds again


class Drivable(Sink, Protocol):
    """A sink that also runs: `collect` yields (device index, sequences finished)."""

    @property
    def has_work(self) -> bool: ...

    def collect(self, wait: float | None) -> Iterator[tuple[int, list[Sequence]]]: ...


def engine_step(
    engine: Engine, label: str = "", hook: Callable[[], None] | None = None, ranges: Any = None
) -> list[Sequence]:
    """One step of `engine`, after the test `hook` (a slowed or failing device) and inside a profiler range."""
    if hook is not None:
        hook()
    if ranges is None:
        return engine.step()
    s = engine.scheduler
    where = f" device={label}" if label else ""
    ranges.push(
        f"hpcinfer/engine_step{where} step={engine.stats.steps} running={len(s.running)} waiting={len(s.waiting)}"
    )
    try:
        return engine.step()
    finally:
        ranges.pop()


class EngineSink:
    """One engine as a sink, stepped by the loop's own thread."""

    def __init__(
        self,
        engine: Engine,
        hook: Callable[[], None] | None = None,
        ranges: RangeBackend | None = None,
        governor: ThreadGovernor | None = None,
    ) -> None:
        self.engine = engine
        self.add = engine.add
        self.hook, self.ranges = hook, ranges
        self.governor = governor  # a CPU engine's thread count under contention (device/threads.py)
        self.last_step_end = 0.0  # perf_counter seconds

    @property
    def queued(self) -> int:
        return len(self.engine.scheduler.waiting)

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def collect(self, wait: float | None) -> Iterator[tuple[int, list[Sequence]]]:
        """Runs one step when there is work; otherwise idles up to `wait` (the next --rate arrival)."""
        if self.engine.has_work:
            if self.governor is not None:
                self.governor.tick()
            finished = engine_step(self.engine, "", self.hook, self.ranges)
            self.last_step_end = time.perf_counter()
            yield 0, finished
        elif wait:
            time.sleep(wait)


def run_loop(
    admission: Admission,
    source: Iterator[PromptRow | Reject],
    sink: Drivable,
    on_finished: Callable[[Sequence, int], None],
    *,
    stop: threading.Event | None = None,
    after: Callable[[], None] | None = None,
) -> None:
    """Until the input is read and every sequence has finished (or `stop` is set)."""
    more = True
    while stop is None or not stop.is_set():
        if more:
            more = admission.feed(source, sink)
        wait = None
        if more and (at := admission.next_at) is not None:  # --rate: no later than the next arrival
            wait = min(max(0.0, at - time.perf_counter()), IDLE_WAIT_S)
        for device, finished in sink.collect(wait):
            for seq in finished:
                on_finished(seq, device)
        if after is not None:
            after()
        if not more and not sink.has_work:
            break
