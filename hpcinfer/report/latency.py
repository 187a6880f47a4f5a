"""Latency: per batch (staged for the device -> its results written) and, under `--rate`, per
request (arrival -> its window committed to disk); the achieved rate and whether the pipeline kept up."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

# Below this share of the offered rate, or with latency still growing at the end, the pipeline
# did not keep up: requests queued faster than it served them.
SATURATION_SHARE = 0.90


def percentiles_ms(values_ns: np.ndarray) -> dict[str, float]:
    if not len(values_ns):
        return {}
    p50, p90, p99 = np.percentile(values_ns / 1e6, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3)}


class LatencyLog:
    """Collects latencies from the writer thread; `summary` turns them into the report's figures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: list[int] = []
        self._requests: list[np.ndarray] = []  # per committed window: latency of each of its rows
        self._arrivals: list[np.ndarray] = []
        self._done_ns: list[int] = []

    def batch_done(self, started_ns: int, now_ns: int) -> None:
        if started_ns:
            with self._lock:
                self._batches.append(now_ns - started_ns)

    def requests_done(self, arrival_ns: np.ndarray, now_ns: int) -> None:
        if len(arrival_ns):
            with self._lock:
                self._requests.append(now_ns - arrival_ns)
                self._arrivals.append(arrival_ns)
                self._done_ns.append(now_ns)

    def batch_summary(self) -> dict[str, float]:
        return percentiles_ms(np.asarray(self._batches, dtype=np.float64))

    def request_summary(self, rate: float | None) -> dict[str, Any]:
        """Per-request latency, offered and achieved rate, and whether the pipeline was saturated."""
        if rate is None or not self._requests:
            return {}
        latency = np.concatenate(self._requests).astype(np.float64)
        arrivals = np.concatenate(self._arrivals)
        n = len(arrivals)
        first, last_arrival, last_done = int(arrivals.min()), int(arrivals.max()), max(self._done_ns)
        offered = (n - 1) / ((last_arrival - first) / 1e9) if n > 1 and last_arrival > first else float(rate)
        achieved = n / ((last_done - first) / 1e9) if last_done > first else 0.0
        # Latency of the last tenth of requests against the first: a queue that keeps growing.
        tenth = max(1, n // 10)
        order = np.argsort(arrivals, kind="stable")
        early, late = np.median(latency[order[:tenth]]), np.median(latency[order[-tenth:]])
        growing = n >= 20 and late > 2 * early + 100e6
        saturated = bool(achieved < SATURATION_SHARE * min(offered, rate) or growing)
        return {
            "latency_ms": percentiles_ms(latency),
            "rate": rate,
            "offered_rate": round(offered, 3),
            "achieved_rate": round(achieved, 3),
            "saturated": saturated,
            "latency_growth": round(float(late / early), 3) if early > 0 else None,
        }
