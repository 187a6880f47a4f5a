"""Device event times on the host's perf_counter_ns timeline, exact for runs of any length.

A device only tells how many milliseconds lie between two of its events, as a float32 (CUDA's
cudaEventElapsedTime). Measured from one reference taken at start, an event an hour later is
~3.6e6 ms away, where a float32 steps by 0.25 ms: spans of a few hundred microseconds become noise.
So the reference is renewed every `renew_ns` of host time: every elapsed time is then at most a few
seconds, exact to well under a microsecond, and the renewal also absorbs drift between the device
and host clocks. Host times stay integers (nanoseconds), never floats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

E = TypeVar("E")


class EventClock(Generic[E]):
    """Maps a completed device event to host nanoseconds through a recent reference event.

    `new_reference()` records an event on an idle stream and waits for it (so it completed "now");
    `elapsed_ms(a, b)` is the device's milliseconds from event a to event b (negative if b is earlier).
    """

    def __init__(
        self,
        new_reference: Callable[[], E],
        elapsed_ms: Callable[[E, E], float],
        now_ns: Callable[[], int] = time.perf_counter_ns,
        renew_ns: float = 1e9,
    ) -> None:
        self._new_reference = new_reference
        self._elapsed_ms = elapsed_ms
        self._now_ns = now_ns
        self._renew_ns = renew_ns
        self._lock = threading.Lock()  # the writer and a report may ask at once
        self.renewals = 0
        self._renew()

    def _renew(self) -> None:
        self._ref = self._new_reference()
        self._ref_ns = self._now_ns()
        self.renewals += 1

    def to_host_ns(self, event: E) -> int:
        with self._lock:
            if self._now_ns() - self._ref_ns > self._renew_ns:
                self._renew()
            return self._ref_ns + round(self._elapsed_ms(self._ref, event) * 1e6)
