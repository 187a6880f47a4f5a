"""Runs the stages: a source, then stages joined by bounded queues, each in its own thread.

`run_overlapped` is the production loop; `run_serial` runs the very same stage objects one item
at a time, depth first: the reference twin every overlap optimisation is checked against.
The first failure in any stage sets `stop`; every other stage notices within ~50 ms, and the
failure is re-raised in the caller's thread with the stage named.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from .device.base import Cancelled
from .errors import HpcinferError, StageError
from .profile import RangeBackend, range_name
from .report.timing import Timings
from .types import END

_POLL_S = 0.05


class _Tick:
    """Returned by `get` instead of an item when the stage's deadline passed with its inbox empty."""


TICK = _Tick()


class Stage(Protocol):
    name: str

    def process(self, item: Any) -> Iterable[Any]: ...

    def finish(self) -> Iterable[Any]: ...


class Source(Protocol):
    name: str

    def produce(self) -> Iterator[Any]: ...


def describe(item: Any) -> dict[str, Any]:
    """Span arguments naming an item: its batch or block, rows and tokens."""
    batch = getattr(item, "batch", item)
    if hasattr(batch, "batch_id"):
        return {
            "batch": batch.batch_id,
            "window": batch.window.window_id,
            "blocks": np.unique(batch.window.block_ids[batch.rows]).tolist(),
            "rows": batch.num_rows,
            "tokens": batch.padded_tokens,
        }
    return {"block": getattr(item, "block_id", -1), "rows": len(item)}


class _Failure:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.stage = ""

    def set(self, stage: str, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error, self.stage = exc, stage

    def raise_if_set(self) -> None:
        if self.error is None:
            return
        if isinstance(self.error, HpcinferError):
            raise self.error
        raise StageError(self.stage, self.error) from self.error


class _Runner:
    def __init__(
        self,
        timings: Timings,
        stop: threading.Event,
        hooks: dict[str, Callable[[Any], None]],
        ranges: RangeBackend | None = None,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        self.thread_init = thread_init  # run first in every thread (Device.bind_thread)
        self.timings = timings
        self.stop = stop
        self.failure = _Failure()
        self.hooks = hooks
        self.ranges = ranges  # NVTX (or recording) ranges around every step, when profiling
        self.local = threading.local()  # the stage this thread is in, to name a failure

    def put(self, name: str, q: queue.Queue, item: Any) -> None:
        t0 = time.perf_counter_ns()
        while True:
            try:
                q.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                if self.stop.is_set():
                    raise Cancelled from None
        self.timings.blocked(name, time.perf_counter_ns() - t0)

    def get(self, name: str, q: queue.Queue, deadline: Callable[[], int | None] | None = None) -> Any:
        """The next item; or TICK once `deadline()` (perf_counter_ns) passes first."""
        t0 = time.perf_counter_ns()
        while True:
            timeout = _POLL_S
            due = deadline() if deadline is not None else None
            if due is not None:
                remaining = (due - time.perf_counter_ns()) / 1e9
                if remaining <= 0:
                    item = TICK
                    break
                timeout = min(timeout, remaining)
            try:
                item = q.get(timeout=timeout)
                break
            except queue.Empty:
                if self.stop.is_set():
                    raise Cancelled from None
        self.timings.starved(name, time.perf_counter_ns() - t0)
        return item

    def timed(self, stage: Stage, fn: Callable[[], Iterable[Any]], item: Any) -> list[Any]:
        """Runs one step of a stage; time it spent waiting for a free buffer counts as back-pressure."""
        name = stage.name
        self.local.stage = name
        hook = self.hooks.get(name)
        if hook is not None and item is not None:
            hook(item)
        waited_before = getattr(stage, "waited_ns", 0)
        args = describe(item) if item is not None else {}
        if self.ranges is not None:
            self.ranges.push(range_name(name, args))
        t0 = time.perf_counter_ns()
        try:
            outputs = list(fn())
        finally:
            if self.ranges is not None:
                self.ranges.pop()
        t1 = time.perf_counter_ns()
        if item is None and not outputs:
            return outputs
        waited = getattr(stage, "waited_ns", 0) - waited_before
        if waited:
            self.timings.blocked(name, waited)
        if name == "plan" and outputs:
            args["batches"] = [b.batch_id for b in outputs]
        self.timings.busy(name, t0 + waited, t1, threading.current_thread().name, **args)
        return outputs

    def next_item(self, name: str, items: Iterator[Any]) -> Any:
        """The source's next item; its range is named once the item (its block id) is known."""
        if self.ranges is None:
            return next(items, END)
        self.ranges.push(f"hpcinfer/{name}")
        try:
            return next(items, END)
        finally:
            self.ranges.pop()

    def guard(self, name: str, body: Callable[[], None]) -> None:
        try:
            if self.thread_init is not None:
                self.thread_init()
            body()
        except Cancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure stops the run and is re-raised
            self.failure.set(getattr(self.local, "stage", name), exc)
            self.stop.set()


def run_overlapped(
    source: Source,
    stages: list[Stage],
    timings: Timings,
    *,
    queue_depth: int,
    workers: dict[str, int],
    stop: threading.Event,
    hooks: dict[str, Callable[[Any], None]] | None = None,
    ranges: RangeBackend | None = None,
    thread_init: Callable[[], None] | None = None,
) -> None:
    """`thread_init` runs first in every thread the pipeline starts (the device's bind_thread)."""
    runner = _Runner(timings, stop, hooks or {}, ranges, thread_init)
    queues = [queue.Queue(maxsize=queue_depth) for _ in stages]

    def source_loop() -> None:
        items = source.produce()
        while not stop.is_set():
            runner.local.stage = source.name
            t0 = time.perf_counter_ns()
            idle_before = getattr(source, "waited_ns", 0)  # an arrival replay sleeping: not work
            hook = runner.hooks.get(source.name)
            if hook is not None:
                hook(None)
            item = runner.next_item(source.name, items)
            if item is END:
                break
            idle = getattr(source, "waited_ns", 0) - idle_before
            if idle:
                timings.starved(source.name, idle)
            timings.busy(
                source.name, t0 + idle, time.perf_counter_ns(), threading.current_thread().name, **describe(item)
            )
            runner.put(source.name, queues[0], item)
        runner.put(source.name, queues[0], END)

    def stage_loop(i: int) -> None:
        stage, inbox = stages[i], queues[i]
        outbox = queues[i + 1] if i + 1 < len(stages) else None
        n_workers = workers.get(stage.name, 1)
        timings.set_workers(stage.name, n_workers)

        def emit(outputs: list[Any]) -> None:
            for out in outputs:
                if outbox is not None:
                    runner.put(stage.name, outbox, out)

        if n_workers > 1:
            _parallel_ordered(runner, stage, inbox, emit, n_workers)
        else:
            deadline = getattr(stage, "deadline_ns", None)  # a stage that closes batches on a timeout
            while (item := runner.get(stage.name, inbox, deadline)) is not END:
                if item is TICK:
                    emit(runner.timed(stage, stage.tick, None))  # type: ignore[attr-defined]
                else:
                    emit(runner.timed(stage, lambda item=item: stage.process(item), item))
        emit(runner.timed(stage, stage.finish, None))
        if outbox is not None:
            runner.put(stage.name, outbox, END)

    threads = [threading.Thread(target=runner.guard, args=(source.name, source_loop), name=source.name)]
    for i, stage in enumerate(stages):
        threads.append(
            threading.Thread(target=runner.guard, args=(stage.name, lambda i=i: stage_loop(i)), name=stage.name)
        )
    for t in threads:
        t.daemon = True
        t.start()
    for t in threads:
        t.join()
    runner.failure.raise_if_set()


def _parallel_ordered(runner: _Runner, stage: Stage, inbox: queue.Queue, emit: Callable, n: int) -> None:
    """Runs `stage.process` on n threads, emitting results in input order."""
    inflight: deque[Future] = deque()
    with ThreadPoolExecutor(n, thread_name_prefix=stage.name, initializer=runner.thread_init) as pool:
        while (item := runner.get(stage.name, inbox)) is not END:
            inflight.append(pool.submit(runner.timed, stage, lambda item=item: stage.process(item), item))
            while len(inflight) >= 2 * n or (inflight and inflight[0].done()):
                emit(inflight.popleft().result())
        while inflight:
            emit(inflight.popleft().result())


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
    runner = _Runner(timings, stop, hooks or {}, ranges, thread_init)

    def push(i: int, item: Any) -> None:
        if i == len(stages):
            return
        for out in runner.timed(stages[i], lambda: stages[i].process(item), item):
            push(i + 1, out)

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
        for i, stage in enumerate(stages):
            for out in runner.timed(stage, stage.finish, None):
                push(i + 1, out)

    runner.guard(source.name, body)
    runner.failure.raise_if_set()
