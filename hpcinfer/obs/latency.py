"""Latency: per batch (staged for the device -> its results written) and, under `--rate`, per
request (arrival -> its window committed to disk); the achieved rate and whether the pipeline kept up.

A distribution is kept for the report as a bounded histogram (`histogram_ms`): log-spaced bins, so
a run of a million requests keeps as many numbers as one of a hundred.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

# Saturated: served under this share of the offered rate, or latency rising with arrival time by
# more than GROWTH_PER_S seconds per second (requests queue faster than they are served).
SATURATION_SHARE = 0.90
GROWTH_PER_S = 0.25


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
        t0, last_arrival, last_done = int(arrivals.min()), int(arrivals.max()), max(self._done_ns)
        offered = (n - 1) / ((last_arrival - t0) / 1e9) if n > 1 and last_arrival > t0 else float(rate)
        achieved = n / ((last_done - t0) / 1e9) if last_done > t0 else 0.0
        # A queue that keeps growing: latency rises with arrival time, ~(offered/capacity - 1)
        # seconds per second once saturated, ~0 while keeping up (Poisson bursts come and go).
        order = np.argsort(arrivals, kind="stable")
        quarter = max(1, n // 4)
        first, last = order[:quarter], order[-quarter:]
        early, late = float(np.median(latency[first])), float(np.median(latency[last]))
        span = float(np.median(arrivals[last]) - np.median(arrivals[first]))
        growth = (late - early) / span if span > 0 else 0.0
        growing = n >= 20 and growth > GROWTH_PER_S and late - early > 250e6
        saturated = bool(achieved < SATURATION_SHARE * min(offered, rate) or growing)
        return {
            "latency_ms": percentiles_ms(latency),
            "rate": rate,
            "offered_rate": round(offered, 3),
            "achieved_rate": round(achieved, 3),
            "saturated": saturated,
            "latency_growth_s_per_s": round(growth, 4),
        }


BINS = 40


def histogram_ms(values_s: list[float], bins: int = BINS) -> dict[str, Any]:
    """{"edges_ms": bins + 1 edges, "counts": bins counts}; empty for no values."""
    if not values_s:
        return {}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    low, high = max(float(ms.min()), 1e-3), max(float(ms.max()), 1e-3)
    if high <= low * 1.0001:
        edges = np.array([low * 0.9, high * 1.1])
        counts = np.array([ms.size])
    else:
        edges = np.geomspace(low, high, bins + 1)
        counts, edges = np.histogram(np.clip(ms, low, high), bins=edges)
    return {"edges_ms": [round(float(e), 4) for e in edges], "counts": [int(c) for c in counts]}
