"""The replicas of a Ray run: actors the driver owns, each with its circuit breaker (place/breaker.py).

A replica's life, as the driver sees it:

    starting --ready--> idle --a unit--> busy --done--> idle
        ^                                  |--a device fault / the actor died--> faulted --breaker
        |                                  |--no progress for --step-timeout: killed-----.  available
        '--------------------------------------------------------------------------------'--------'

A fault counts against the replica's breaker (a hang opens it at once) and its unit goes back to
the driver's queue, for another replica. Before a faulted replica gets work again (at once while
its breaker is closed, after the cool-down once it opened) its process is replaced: Ray restarts
the actor (`max_restarts=-1`), as it restarts one that died, so a sticky device error, a leaked
allocation or a thread stuck in a hung device goes with the old process. A hung replica is killed
at once: its thread cannot be stopped, and its device is needed free. The breaker outlives the
processes: it belongs to the replica (the actor handle), not to a pid.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import DevicesFailed
from ..place.breaker import Breaker, BreakerLog, BreakerSettings
from .units import Unit

STARTING, IDLE, BUSY, FAULTED = "starting", "idle", "busy", "faulted"


@dataclass(slots=True)
class Replica:
    index: int
    label: str  # replica#k: the breaker's name, in transitions and the final error
    actor: Any
    breaker: Breaker
    state: str = STARTING
    call: Any = None  # the pending ready() or run() call
    unit: Unit | None = None  # while busy
    name: str = ""  # host:pid of its current process, once it answered
    stale: str = ""  # a process killed by the driver: a ready() it answers is no news
    replace: bool = False  # faulted: its process lives on and must be replaced (not one that died)
    ask_at: float = 0.0  # starting, no call out: when to ask again (time.monotonic())
    beat: Any = None  # the pending heartbeat() call while busy
    beat_sent: float = 0.0  # time.monotonic() when it was sent

    def title(self) -> str:
        return f"{self.label} ({self.name})" if self.name else self.label


class ReplicasFailed(DevicesFailed):
    """Every replica's breaker is open: the run ends, naming each replica and its last error."""

    def __init__(self, replicas: list[Replica]) -> None:
        failures = {r.title(): r.breaker.last_error or "no error seen" for r in replicas}
        super().__init__(failures, RuntimeError(replicas[-1].breaker.last_error))
        self.args = ("every replica failed: " + "; ".join(f"{k}: {v}" for k, v in failures.items()),)


class ReplicaSet:
    """The run's actors and their breakers: start, send a unit, count a fault, replace, close."""

    def __init__(
        self,
        ray: Any,
        actor_cls: type,
        count: int,
        args: dict[str, Any],
        options: dict[str, Any],
        settings: BreakerSettings,
        listener: Callable[[Any], None] | None = None,
    ) -> None:
        self.ray = ray
        self.log = BreakerLog(listener=listener)
        remote = ray.remote(actor_cls).options(
            max_restarts=-1,  # NOTE: Ray replaces a dead process; the breaker decides when it gets work
            max_concurrency=2,  # a unit, and the heartbeat the driver asks for while it runs
            scheduling_strategy="SPREAD",  # as many nodes as there are replicas (CPU sizing assumes it)
            **options,
        )
        self.all = [
            Replica(k, f"replica#{k}", remote.remote(**args), Breaker(f"replica#{k}", settings, self.log))
            for k in range(count)
        ]
        for r in self.all:
            self.start(r)

    def start(self, r: Replica) -> None:
        r.state, r.call, r.unit, r.beat = STARTING, r.actor.ready.remote(), None, None

    def started(self, r: Replica, ready: Any, wait_s: float) -> bool:
        """A ready() answer: False when it came from a process the driver killed (asked again later:
        a kill takes effect a moment after `ray.kill` returns)."""
        if r.stale and ready.name == r.stale:
            self.restarting(r, wait_s)
            return False
        r.name, r.stale, r.state, r.call = ready.name, "", IDLE, None
        return True

    def restarting(self, r: Replica, wait_s: float) -> None:
        """A ready() call found the actor restarting (Ray refuses calls meanwhile): asked again later."""
        r.call, r.ask_at = None, time.monotonic() + wait_s

    def send(self, r: Replica, unit: Unit) -> None:
        r.state, r.unit, r.call, r.beat = BUSY, unit, r.actor.run.remote(unit), None

    def done(self, r: Replica) -> None:
        r.breaker.success()  # NOTE: a replica on trial that finished its unit is back
        r.state, r.unit, r.call, r.beat = IDLE, None, None, None

    def fault(self, r: Replica, error: str, *, died: bool = False, hung: bool = False) -> Unit | None:
        """Counts a fault against `r`; returns the unit it held (for another replica)."""
        unit = r.unit
        r.unit, r.call, r.beat = None, None, None
        if hung:
            r.breaker.trip(error)
            self._kill(r)  # NOTE: at once: a thread stuck in a device cannot be stopped otherwise
            self.start(r)
            return unit
        r.breaker.failure(error)
        r.state, r.replace = FAULTED, not died
        return unit

    def renew(self) -> None:
        """Faulted replicas whose breakers let them work again get a fresh process (Ray restarts it);
        restarting ones are asked again whether they are ready."""
        for r in self.all:
            if r.state == FAULTED and r.breaker.available():
                if r.replace:
                    self._kill(r)
                self.start(r)
            elif r.state == STARTING and r.call is None and time.monotonic() >= r.ask_at:
                self.start(r)

    def close(self) -> None:
        for r in self.all:
            self.ray.kill(r.actor, no_restart=True)

    def _kill(self, r: Replica) -> None:
        r.stale = r.name
        self.ray.kill(r.actor, no_restart=False)
