"""What the HTML report's charts plot, derived from a report's timeline (obs/timeline.py): rates
from counters, shares of busy time, spans between breaker transitions. Pure Python, no plotting."""

from __future__ import annotations

import math
from typing import Any

Points = tuple[list[float], list[float]]


def column(timeline: dict[str, Any], name: str) -> list[float | None]:
    return timeline.get("series", {}).get(name, [])


def names(timeline: dict[str, Any], family: str) -> list[str]:
    """The labels of a family's series ('stage_busy_s' -> ['compute', 'read', ...])."""
    prefix = family + "."
    return [k[len(prefix) :] for k in timeline.get("series", {}) if k.startswith(prefix)]


def gauge(timeline: dict[str, Any], name: str) -> Points:
    ts, vs = [], []
    for t, v in zip(timeline.get("t", []), column(timeline, name), strict=False):
        if v is not None:
            ts.append(t)
            vs.append(v)
    return ts, vs


SMOOTH_S = 2.0  # a rate spans at least this long (batches land in steps), where the run is long enough
SMOOTH_SHARE = 60  # ... and at least this share of the timeline (1/60 of it)


def rate(timeline: dict[str, Any], name: str, per: str | None = None) -> Points:
    """A counter's increase per second, or, with `per`, per unit of another counter's increase
    (cached tokens per prompt token: a hit rate), at each sample over a sliding window: at least
    SMOOTH_S seconds (a quarter of the samples at most) and 1/SMOOTH_SHARE of the timeline, so the
    line shows the trend rather than each batch landing. Windows with nothing to divide by (no
    new prompt tokens) are left out."""
    t = timeline.get("t", [])
    values = column(timeline, name)
    below = column(timeline, per) if per else t
    known = [(now, v, u) for now, v, u in zip(t, values, below, strict=False) if v is not None and u is not None]
    interval = float(timeline.get("interval_s") or 1.0)
    k = max(1, min(math.ceil(SMOOTH_S / interval), len(known) // 4), len(known) // SMOOTH_SHARE)
    ts, vs = [], []
    for (_, v0, u0), (now, v1, u1) in zip(known, known[k:], strict=False):
        if u1 - u0 > 0:
            ts.append(now)
            vs.append((v1 - v0) / (u1 - u0))
    return ts, vs


def shares(timeline: dict[str, Any], family: str, workers: dict[str, int] | None = None) -> dict[str, Points]:
    """Each label's busy seconds per wall second in each interval (divided by its workers)."""
    out = {}
    for label in names(timeline, family):
        ts, vs = rate(timeline, f"{family}.{label}")
        w = max(1, (workers or {}).get(label, 1))
        if any(vs):
            out[label] = (ts, [v / w for v in vs])
    return out


def commit_times(timeline: dict[str, Any]) -> list[float]:
    return [e["t"] for e in timeline.get("events", []) if e.get("kind") == "commit"]


def breaker_spans(timeline: dict[str, Any], end: float) -> list[dict[str, Any]]:
    """Each device's time out of the closed state: {device, state, start, end}, from its transitions."""
    spans: list[dict[str, Any]] = []
    opened: dict[str, tuple[str, float]] = {}
    for e in timeline.get("events", []):
        if e.get("kind") != "breaker":
            continue
        device, state, at = e["device"], e["state"], e["t"]
        if device in opened:
            was, since = opened.pop(device)
            spans.append({"device": device, "state": was, "start": since, "end": at})
        if state != "closed":
            opened[device] = (state, at)
    for device, (state, since) in opened.items():
        spans.append({"device": device, "state": state, "start": since, "end": end})
    return spans
