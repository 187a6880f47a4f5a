"""A latency distribution as a bounded histogram for the report: log-spaced bins, so a run of a
million requests keeps as many numbers as one of a hundred."""

from __future__ import annotations

from typing import Any

import numpy as np

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
