"""The serial twin of the stage pipeline: each item goes through every stage before the next is read.

It runs the very same stage objects as `pipeline.run_overlapped`, one item at a time, depth first,
on the caller's thread: the reference every overlap optimisation is checked against (--no-overlap)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..obs.profile import RangeBackend
from ..obs.timing import Timings
from ..types import END
from .overlap import Fanout, Runner, Source, Stage, describe


def run_serial(
    source: Source,
    stages: list[Stage],
    timings: Timings,
    *,
    stop: threading.Event,
    hooks: dict[str, Callable[[Any], None]] | None = None,
    ranges: RangeBackend | None = None,
    thread_init: Callable[[], None] | None = None,
) -> None:
    """The reference twin: each item goes through every stage before the next one is read."""
    runner = Runner(timings, stop, hooks or {}, ranges, thread_init)

    def push(i: int, item: Any) -> None:
        if i == len(stages):
            return
        stage = stages[i]
        if isinstance(stage, Fanout):
            run_chain(stage, stage.route(item), 0, item, i + 1)
            return
        for out in runner.timed(stage, lambda: stage.process(item), item):
            push(i + 1, out)

    def run_chain(fan: Fanout, branch: int, k: int, item: Any, then: int) -> None:
        """Item through stages k.. of one branch, then on to stage `then` of the main line."""
        steps = fan.branches[branch]
        if k == len(steps):
            push(then, item)
            return
        if (init := fan.init(branch)) is not None:
            init()  # NOTE: one thread runs every device's work here: bind the one whose turn it is
        runner.local.where = fan.label(branch)  # kept if it fails: the failure names the device
        outputs = runner.timed(steps[k], lambda: steps[k].process(item), item)
        runner.local.where = None
        for out in outputs:
            run_chain(fan, branch, k + 1, out, then)

    def finish(i: int) -> None:
        stage = stages[i]
        if not isinstance(stage, Fanout):
            for out in runner.timed(stage, stage.finish, None):
                push(i + 1, out)
            return
        for b, steps in enumerate(stage.branches):
            for k, step in enumerate(steps):
                for out in runner.timed(step, step.finish, None):
                    run_chain(stage, b, k + 1, out, i + 1)

    def body() -> None:
        items = source.produce()
        while not stop.is_set():
            runner.local.stage = source.name
            hook = runner.hooks.get(source.name)
            if hook is not None:
                hook(None)
            t0 = time.perf_counter_ns()
            item = runner.next_item(source.name, items)
            if item is END:
                break
            timings.busy(source.name, t0, time.perf_counter_ns(), threading.current_thread().name, **describe(item))
            push(0, item)
        for i in range(len(stages)):
            finish(i)

    runner.guard(source.name, body)
    runner.failure.raise_if_set()
