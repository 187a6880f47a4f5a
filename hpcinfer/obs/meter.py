"""A run's live figures, read while it runs: by the timeline (timeline.py: the report's charts) and
by the Prometheus endpoint (metrics.py), so both show the same numbers.

A figure is a name with an optional label, `family.label` ("rows.done", "stage_busy_s.read",
"device_rows.cpu#0"), and is either fed (`add`: the progress line's rows and tokens) or read when
asked (`probe`: a callable over the job's own counters, registered by the task that owns them).
Events (a window committed, a breaker changed state) are kept with their time, a bounded number.
Thread-safe for what it holds behind its lock (fed values, probes, events); `kinds` and `facts`
are plain dicts each key of which is written once, at registration. Reading costs the probes'
calls, nothing is computed between reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

COUNTER, GAUGE = "counter", "gauge"
MAX_COMMIT_EVENTS = 400  # past this, every other commit mark is dropped (the bound on a long job's report)
MAX_OTHER_EVENTS = 2000  # breaker transitions and the like: rare, kept up to this many


@dataclass(slots=True)
class Events:
    """Timed events, bounded: commit marks are thinned to every other once there are too many."""

    commits: list[dict[str, Any]] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)
    commit_stride: int = 1  # one commit in this many is kept
    seen_commits: int = 0
    dropped: int = 0

    def add(self, event: dict[str, Any]) -> None:
        if event["kind"] != "commit":
            if len(self.other) < MAX_OTHER_EVENTS:
                self.other.append(event)
            else:
                self.dropped += 1
            return
        self.seen_commits += 1
        if (self.seen_commits - 1) % self.commit_stride:
            self.dropped += 1
            return
        self.commits.append(event)
        if len(self.commits) > MAX_COMMIT_EVENTS:
            self.dropped += len(self.commits) - len(self.commits[::2])
            self.commits = self.commits[::2]
            self.commit_stride *= 2

    def to_list(self) -> list[dict[str, Any]]:
        return sorted([*self.commits, *self.other], key=lambda e: e["at"])


class Meter:
    """The live figures of one run; `start` is the zero of every time it records."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start = clock()
        self._lock = threading.Lock()
        self._fed: dict[str, float] = {}
        self._probes: dict[str, Callable[[], float]] = {}
        self.kinds: dict[str, str] = {}  # figure -> counter | gauge
        self.facts: dict[str, Any] = {}  # fixed figures of the run: stage workers, the KV pool's size
        self.events = Events()
        self._job_started = False

    def elapsed(self) -> float:
        return self.clock() - self.start

    def job_started(self) -> None:
        """The job itself starts (its model loaded, its input opened): every time recorded is
        counted from here, the report's own zero; what came before has negative times."""
        with self._lock:
            if not self._job_started:
                self._job_started = True
                self.start = self.clock()

    def add(self, name: str, value: float) -> None:
        """Adds to a fed counter."""
        with self._lock:
            self._fed[name] = self._fed.get(name, 0) + value
            self.kinds.setdefault(name, COUNTER)

    def set(self, name: str, value: float) -> None:
        """Sets a fed gauge."""
        with self._lock:
            self._fed[name] = value
            self.kinds.setdefault(name, GAUGE)

    def probe(self, name: str, read: Callable[[], float], kind: str = GAUGE, *, carry: bool = False) -> None:
        """Registers a figure read when asked; a counter's reads must never fall. `carry`: a counter
        registered again (the pipeline restarted on fewer devices, from zero) goes on from where
        the one it replaces had got to."""
        with self._lock:
            old = self._probes.get(name)
        base = 0.0
        if carry and old is not None:
            try:
                base = float(old())
            except Exception:  # noqa: BLE001  NOTE: a torn-down job's figure: counted from zero again
                base = 0.0
        with self._lock:
            self._probes[name] = read if not base else (lambda: base + read())
            self.kinds[name] = kind

    def event(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self.events.add({"at": self.clock(), "kind": kind, **fields})

    def read(self) -> dict[str, float]:
        """Every figure now; a probe that fails (its job is being torn down) is left out of this read."""
        with self._lock:
            values = dict(self._fed)
            probes = list(self._probes.items())
        for name, read in probes:
            try:
                values[name] = float(read())
            except Exception:  # noqa: BLE001  NOTE: a figure missing from one read is better than a failed run
                continue
        return values

    def event_list(self) -> tuple[list[dict[str, Any]], int]:
        """The events, each timed in seconds since the start (`t`)."""
        with self._lock:
            events, start = self.events.to_list(), self.start
            timed = [{"t": round(e["at"] - start, 3), **{k: v for k, v in e.items() if k != "at"}} for e in events]
            return timed, self.events.dropped


def family(name: str) -> tuple[str, str | None]:
    """'rows.done' -> ('rows', 'done'); 'running' -> ('running', None)."""
    head, _, label = name.partition(".")
    return head, label or None
