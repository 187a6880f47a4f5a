"""The run's figures over time: a thread reads the meter (meter.py) every `interval_s`, and the series
stay bounded however long the job runs.

When a series reaches `max_points`, neighbouring samples are merged in pairs and the interval is
doubled: a counter keeps the later value (a cumulative value is exact at any point kept), a gauge
the mean of the two. A 10-hour job's timeline therefore holds as many points as a 10-minute one's,
at a coarser step. Rates are not stored: the report divides a counter's differences by the time's.
"""

from __future__ import annotations

import threading
from typing import Any

from .meter import COUNTER, Meter

INTERVAL_S = 0.25  # doubled each time the points reach MAX_POINTS: 150 s at this step, then 300 s at 0.5 s...
MAX_POINTS = 600


class Timeline:
    def __init__(self, meter: Meter, interval_s: float = INTERVAL_S, max_points: int = MAX_POINTS) -> None:
        if max_points < 4:
            raise ValueError("a timeline keeps at least 4 points")
        self.meter = meter
        self.interval_s = interval_s
        self.max_points = max_points
        self.t: list[float] = []
        self.series: dict[str, list[float | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Timeline:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="hpcinfer-timeline", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        """Stops sampling, after one last sample: the series end with the run's final figures."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()

    def sample(self) -> None:
        values = self.meter.read()
        now = self.meter.clock()
        with self._lock:
            self.t.append(now)
            for name, value in values.items():
                column = self.series.setdefault(name, [None] * (len(self.t) - 1))
                column.append(value)
            for column in self.series.values():
                if len(column) < len(self.t):
                    column.append(None)
            if len(self.t) >= self.max_points:
                self._halve()

    def _halve(self) -> None:
        """Pairs merged: (0, 1), (2, 3), ...; an odd last sample is kept as it is."""
        self.t = [self.t[min(i + 1, len(self.t) - 1)] for i in range(0, len(self.t), 2)]
        for name, column in self.series.items():
            counter = self.meter.kinds.get(name) == COUNTER
            self.series[name] = [_merge(column[i : i + 2], counter) for i in range(0, len(column), 2)]
        self.interval_s *= 2

    def to_dict(self) -> dict[str, Any]:
        events, dropped = self.meter.event_list()
        with self._lock:
            return {
                "interval_s": self.interval_s,
                "t": [round(t - self.meter.start, 3) for t in self.t],
                "series": {k: list(v) for k, v in sorted(self.series.items())},
                "kinds": {k: self.meter.kinds.get(k, "gauge") for k in sorted(self.series)},
                "facts": dict(self.meter.facts),
                "events": events,
                "events_dropped": dropped,
            }


def _merge(pair: list[float | None], counter: bool) -> float | None:
    if counter or len(pair) == 1:
        return pair[-1]  # NOTE: a counter's value is its value at the later time, or unknown there
    known = [v for v in pair if v is not None]
    return sum(known) / len(known) if known else None
