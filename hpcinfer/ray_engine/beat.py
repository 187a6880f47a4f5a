"""A replica's heartbeat: when the unit it runs last moved, which the driver's `--step-timeout` watches.

Embedding moves with each batch written (the engine reports it as progress: a `Beat` is the run's
`Progress`, shown nowhere); generation with each engine step begun (the replica calls the beat
before every step). The age is taken on the replica's own clock, so the clocks of the driver and
the nodes never meet.
"""

from __future__ import annotations

import threading
import time

from ..obs.progress import Progress


class Beat(Progress):
    """`start()` when a unit begins, `touch()` (or `advance`) as it moves, `stop()` when it ends;
    `age()` is how long the unit in progress has not moved (0 between units)."""

    def __init__(self) -> None:
        super().__init__("off")
        self._at: float | None = None
        self._beat_lock = threading.Lock()

    def start(self) -> None:
        self.touch()

    def touch(self) -> None:
        with self._beat_lock:
            self._at = time.monotonic()

    def stop(self) -> None:
        with self._beat_lock:
            self._at = None

    def age(self) -> float:
        with self._beat_lock:
            return 0.0 if self._at is None else time.monotonic() - self._at

    def advance(self, rows: int, tokens: int, device: int = 0) -> None:
        self.touch()
        super().advance(rows, tokens, device)
