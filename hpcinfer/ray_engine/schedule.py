"""Every unit of a Ray run through the replicas, around the ones that fail: the driver's dispatch loop.

    pending units (window order) --dispatch--> an idle replica whose breaker lets it work
    ray.wait(its calls) --> ready: idle | done: yield the result | fault: the unit back to pending

One unit at a time per replica: the driver chooses each unit's replica, so an open replica gets
nothing, a failed unit goes to a replica it has not failed on (when one can still work; the
replica it failed on otherwise, as a transient fault may pass), and a replica past its cool-down
gets a trial. Units go out lowest window first, so the ordered commit never waits long. While a
replica runs a unit the driver asks it, every fraction of `--step-timeout`, how long the unit has
not moved; a replica past the timeout, or one that does not answer within it, is hung. The run
fails when units are left and no replica's breaker lets it work (ReplicasFailed).

NOTE: why the driver, and not Ray Data's actor pool (`map_batches`), hands out the units. A
breaker needs the scheduler to keep work from an open replica, to send a failed unit elsewhere
and to try a recovered replica again; Ray Data picks the actor of each block itself, and none of
that can be asked of it. An open replica that declines its blocks is the least busy actor, so Ray
Data hands it most of the rest, and every round of declined blocks is a new pool (models loaded
again, the breakers' replicas gone with their actors). What Ray Data gave this engine (actors
placed with their CPUs and GPUs, dead ones restarted, results through the object store) is Ray's
own, used here directly; its datasets were never used (each replica reads its own rows).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import HpcinferError
from ..obs.progress import Progress
from .replicas import BUSY, IDLE, STARTING, Replica, ReplicaSet, ReplicasFailed
from .units import Unit


class ReplicaError(HpcinferError):
    """A replica's unit failed for a user's reason (a file changed under the run, say), or Ray itself failed."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Scheduler:
    """`results()` yields each unit's result once, in any order, whatever failed on the way."""

    def __init__(
        self,
        ray: Any,
        replicas: ReplicaSet,
        units: list[Unit],
        step_timeout: float | None,
        progress: Progress,
        stop: threading.Event | None = None,
    ) -> None:
        """`stop`, set by the caller (a server cancelling its batch), ends `results()` as Ctrl-C does."""
        self.ray, self.replicas, self.step_timeout, self.progress = ray, replicas, step_timeout, progress
        self.stop = stop
        self.pending: list[tuple[int, Unit]] = sorted((u.window_id, u) for u in units)
        self.failed_on: dict[int, set[int]] = {}  # window -> replicas it failed on
        self.moved: dict[str, dict[str, int]] = {}  # replica -> windows and rows moved away from it
        cooldown = replicas.all[0].breaker.settings.cooldown_s
        self.poll_s = max(0.05, min(1.0, step_timeout or 1.0, cooldown or 1.0) / 4)

    def results(self) -> Iterator[Any]:
        while self.pending or any(r.state == BUSY for r in self.replicas.all):
            if self.stop is not None and self.stop.is_set():
                raise KeyboardInterrupt  # NOTE: the committed windows stay; the driver says how to resume
            self.replicas.renew()
            self._dispatch()
            calls = self._calls()
            if not calls:  # NOTE: only while every replica that may work is between processes
                time.sleep(self.poll_s)
                continue
            ready, _ = self.ray.wait(list(calls), num_returns=1, timeout=self.poll_s)
            if ready:
                rest = [c for c in calls if c not in ready]
                ready += self.ray.wait(rest, num_returns=len(rest), timeout=0)[0] if rest else []
            for ref in ready:
                r, kind = calls[ref]
                if ref != (r.beat if kind == "beat" else r.call):
                    continue  # NOTE: dropped by what an earlier answer of this round did to its replica
                if kind == "beat":
                    self._beat(r, ref)
                elif r.state == STARTING:
                    self._ready(r, ref)
                else:
                    yield from self._result(r, ref)
            self._watch()

    def figures(self) -> dict[str, Any]:
        """The report's `cluster` figures of the breakers: windows and rows moved, and from where."""
        return {
            "windows_moved": sum(m["windows"] for m in self.moved.values()),
            "rows_moved": sum(m["rows"] for m in self.moved.values()),
            "moved_from": self.moved,
        }

    def _calls(self) -> dict[Any, tuple[Replica, str]]:
        calls: dict[Any, tuple[Replica, str]] = {}
        for r in self.replicas.all:
            if r.call is not None:
                calls[r.call] = (r, "call")
            if r.beat is not None:
                calls[r.beat] = (r, "beat")
        return calls

    def _dispatch(self) -> None:
        """Units, lowest window first, to idle replicas whose breakers let them work."""
        every = self.replicas.all
        working = [r for r in every if r.breaker.available()]  # NOTE: an open one past its cool-down: on trial
        if self.pending and not working:
            raise ReplicasFailed(every)
        idle = [r for r in working if r.state == IDLE]
        for window, unit in list(self.pending):
            if not idle:
                return
            failed = self.failed_on.get(window, set())
            fresh = [r for r in idle if r.index not in failed]
            if not fresh and any(r.index not in failed for r in working):
                continue  # a replica it has not failed on will be free: it waits for that one
            chosen = (fresh or idle)[0]
            idle.remove(chosen)
            self.pending.remove((window, unit))
            self.replicas.send(chosen, unit)

    def _ready(self, r: Replica, ref: Any) -> None:
        try:
            ready = self.ray.get(ref)
        except self.ray.exceptions.ActorUnavailableError:  # restarting (a model may take minutes to load)
            self.replicas.restarting(r, self.poll_s)
            return
        except self.ray.exceptions.RayActorError as exc:  # gone for good (its node, say)
            self._fault(r, f"the actor died: {_one_line(exc)}", died=True)
            return
        if not self.replicas.started(r, ready, self.poll_s):
            return
        if ready.cores:
            self.progress.note(f"hpcinfer: {r.label} ({ready.name}) on cores {ready.cores}, the nearest its GPUs")
        if ready.error is not None:
            raise ReplicaError(*ready.error)
        if ready.fault is not None:
            self._fault(r, ready.fault)

    def _result(self, r: Replica, ref: Any) -> Iterator[Any]:
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:  # the process died (Ray restarts it)
            self._fault(r, f"the actor died: {_one_line(exc)}", died=True)
            return
        except self.ray.exceptions.RayError as exc:  # Ray itself, or a replica's bug: one line
            raise ReplicaError(f"the Ray job failed: {_one_line(exc)}", 1) from exc
        if result.error is not None:
            raise ReplicaError(*result.error)
        if result.fault is not None:
            self._fault(r, result.fault)
            return
        self.replicas.done(r)
        result.replica = f"{r.label} {result.replica}"
        yield result

    def _beat(self, r: Replica, ref: Any) -> None:
        r.beat = None
        try:
            age = self.ray.get(ref)
        except self.ray.exceptions.RayError:
            return  # the unit's own call says what happened to the actor
        if self.step_timeout is not None and age > self.step_timeout:
            self._fault(r, f"no progress in {age:.1f} s (--step-timeout {self.step_timeout:g} s)", hung=True)

    def _watch(self) -> None:
        """Asks each busy replica how long its unit has not moved; one that does not answer is hung."""
        if self.step_timeout is None:
            return
        now = time.monotonic()
        for r in self.replicas.all:
            if r.state != BUSY:
                continue
            if r.beat is None and now - r.beat_sent >= self.poll_s:
                r.beat, r.beat_sent = r.actor.heartbeat.remote(), now
            elif r.beat is not None and now - r.beat_sent > self.step_timeout:
                self._fault(r, f"no answer in {self.step_timeout:g} s (--step-timeout)", hung=True)

    def _fault(self, r: Replica, error: str, *, died: bool = False, hung: bool = False) -> None:
        unit = self.replicas.fault(r, error, died=died, hung=hung)
        if unit is None:
            return
        bisect.insort(self.pending, (unit.window_id, unit))
        self.failed_on.setdefault(unit.window_id, set()).add(r.index)
        moved = self.moved.setdefault(r.label, {"windows": 0, "rows": 0})
        moved["windows"] += 1
        moved["rows"] += unit.input_rows
        self.progress.note(f"hpcinfer: window {unit.window_id} ({unit.input_rows:,} rows) moved from {r.label}")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
