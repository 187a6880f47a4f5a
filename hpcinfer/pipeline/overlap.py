"""Runs the stages: a source, then stages joined by bounded queues, each in its own thread.

`run_overlapped` is the production loop; `serial.run_serial` runs the very same stage objects one
item at a time, depth first: the reference twin every overlap optimisation is checked against.
A `Fanout` in the list of stages splits the flow over parallel branches (one per device), each a
chain of stages in threads of its own, merging again into the next stage.
The first failure in any stage (or Ctrl-C) sets `stop`; every other stage notices at its next
queue operation, or within ~50 ms while it waits on one, and the failure is re-raised in the
caller's thread with the stage named.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from ..device.base import Cancelled
from ..errors import HpcinferError, StageError
from ..obs.profile import RangeBackend, range_name
from ..obs.timing import Timings
from ..types import END

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


@dataclass(slots=True)
class Fanout:
    """Parallel branches at one position of the pipeline: `route(item)` names each item's branch.

    Every branch is a chain of stages, each in its own thread, which runs `thread_inits[branch]`
    first (the branch's device binds itself there). The branches' outputs merge into the next
    stage's inbox, which ends once every branch has ended.
    """

    name: str
    route: Callable[[Any], int]
    branches: list[list[Stage]]
    thread_inits: list[Callable[[], None] | None] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # a branch's name (its device), for threads and errors

    def label(self, branch: int) -> str:
        return self.labels[branch] if branch < len(self.labels) else str(branch)

    def init(self, branch: int) -> Callable[[], None] | None:
        return self.thread_inits[branch] if branch < len(self.thread_inits) else None


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


WATCH_EVERY_S = 0.1  # how often a watchdog is asked
HUNG_GRACE_S = 2.0  # after a hang, how long the other threads get to stop


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


class Runner:
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
            if self.stop.is_set():  # NOTE: checked first too: a queue that never fills would never time out
                raise Cancelled
            try:
                q.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                pass
        self.timings.blocked(name, time.perf_counter_ns() - t0)

    def get(self, name: str, q: queue.Queue, deadline: Callable[[], int | None] | None = None) -> Any:
        """The next item; or TICK once `deadline()` (perf_counter_ns) passes first."""
        t0 = time.perf_counter_ns()
        while True:
            if self.stop.is_set():
                raise Cancelled
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
                pass
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

    def guard(self, name: str, body: Callable[[], None], init: Callable[[], None] | None = None) -> None:
        try:
            if (init := init or self.thread_init) is not None:
                init()
            body()
        except Cancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure stops the run and is re-raised
            stage = getattr(self.local, "stage", name)
            where = getattr(self.local, "where", None)  # the device of a fan-out branch
            self.failure.set(f"{stage}@{where}" if where else stage, exc)
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
    watchdog: Callable[[], tuple[str, BaseException] | None] | None = None,
) -> None:
    """`thread_init` runs first in every thread the pipeline starts (the device's bind_thread).

    `watchdog`, polled while the stages run, names a hung stage and its error (a device that
    stopped returning results): the run fails as if that stage had raised, and the pipeline gives
    up on threads still blocked in it (daemons, left behind) instead of waiting for them forever.
    """
    runner = Runner(timings, stop, hooks or {}, ranges, thread_init)
    hung = threading.Event()
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

    def stage_loop(
        stage: Stage, inbox: queue.Queue, outbox: queue.Queue | None, producers: int = 1, copies: int = 1
    ) -> None:
        n_workers = workers.get(stage.name, 1)
        timings.set_workers(stage.name, n_workers * copies)  # NOTE: a stage run by every branch is timed as one

        def emit(outputs: list[Any]) -> None:
            for out in outputs:
                if outbox is not None:
                    runner.put(stage.name, outbox, out)

        if n_workers > 1:
            _parallel_ordered(runner, stage, inbox, emit, n_workers)
        else:
            deadline = getattr(stage, "deadline_ns", None)  # a stage that closes batches on a timeout
            ended = 0
            while ended < producers:
                item = runner.get(stage.name, inbox, deadline)
                if item is END:
                    ended += 1  # NOTE: after a fan-out, every branch sends its own END
                elif item is TICK:
                    emit(runner.timed(stage, stage.tick, None))  # type: ignore[attr-defined]
                else:
                    emit(runner.timed(stage, lambda item=item: stage.process(item), item))
        emit(runner.timed(stage, stage.finish, None))
        if outbox is not None:
            runner.put(stage.name, outbox, END)

    def branch_loop(label: str, *args: Any) -> None:
        runner.local.where = label
        stage_loop(*args)

    def route_loop(fan: Fanout, inbox: queue.Queue, inboxes: list[queue.Queue]) -> None:
        while (item := runner.get(fan.name, inbox)) is not END:
            runner.put(fan.name, inboxes[fan.route(item)], item)
        for branch_inbox in inboxes:
            runner.put(fan.name, branch_inbox, END)

    threads = [threading.Thread(target=runner.guard, args=(source.name, source_loop), name=source.name)]

    def start(name: str, body: Callable[[], None], init: Callable[[], None] | None = None) -> None:
        threads.append(threading.Thread(target=runner.guard, args=(name, body, init), name=name))

    producers = 1
    for i, stage in enumerate(stages):
        inbox, outbox = queues[i], queues[i + 1] if i + 1 < len(stages) else None
        if isinstance(stage, Fanout):
            chains = [[queue.Queue(maxsize=queue_depth) for _ in branch] for branch in stage.branches]
            start(stage.name, lambda f=stage, q=inbox, c=chains: route_loop(f, q, [chain[0] for chain in c]))
            for b, (branch, chain) in enumerate(zip(stage.branches, chains, strict=True)):
                for k, step in enumerate(branch):
                    out = chain[k + 1] if k + 1 < len(branch) else outbox
                    body = partial(branch_loop, stage.label(b), step, chain[k], out, 1, len(stage.branches))
                    start(f"{step.name}@{stage.label(b)}", body, stage.init(b))
            producers = len(stage.branches)
            continue
        start(stage.name, lambda s=stage, q=inbox, o=outbox, p=producers: stage_loop(s, q, o, p))
        producers = 1
    for t in threads:
        t.daemon = True
        t.start()
    given_up = 0.0
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(WATCH_EVERY_S)
        if watchdog is not None and not hung.is_set() and (found := watchdog()) is not None:
            runner.failure.set(*found)
            stop.set()
            hung.set()
            given_up = time.perf_counter() + HUNG_GRACE_S
        if hung.is_set() and time.perf_counter() > given_up:
            break  # NOTE: the threads still alive wait on the hung device; they are daemons
    runner.failure.raise_if_set()


def _parallel_ordered(runner: Runner, stage: Stage, inbox: queue.Queue, emit: Callable, n: int) -> None:
    """Runs `stage.process` on n threads, emitting results in input order."""
    inflight: deque[Future] = deque()
    with ThreadPoolExecutor(n, thread_name_prefix=stage.name, initializer=runner.thread_init) as pool:
        while (item := runner.get(stage.name, inbox)) is not END:
            inflight.append(pool.submit(runner.timed, stage, lambda item=item: stage.process(item), item))
            while len(inflight) >= 2 * n or (inflight and inflight[0].done()):
                emit(inflight.popleft().result())
        while inflight:
            emit(inflight.popleft().result())
