"""The replicas' figures -> one report of the whole job: the parts every task's merge shares.

Stage tables are merged by summing what adds up (items, busy, starved, back-pressured seconds);
a stage's share is its busy time over the replicas' combined time (replicas x wall), so 100% means
every replica spent the whole job in it. Per-batch percentiles do not add up: p50 is the items-
weighted median of the units' p50s, p99 the highest unit p99 (an upper bound). Each actor gets a
row of the per-device table (batches, rows, tokens, token share, busy seconds and share of the
wall time, idle tail), and `cluster` names the slowest actor (fewest rows per busy second).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

_ADDED = ("items", "busy_s", "starved_s", "backpressured_s")


def merge_stages(reports: list[Any], wall_s: float, replicas: int) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    p50s: dict[str, list[tuple[float, int]]] = {}
    for report in reports:
        for s in report.stages:
            row = merged.setdefault(s["stage"], {"stage": s["stage"], **dict.fromkeys(_ADDED, 0), "p99_ms": 0.0})
            for key in _ADDED:
                row[key] += s[key]
            row["p99_ms"] = max(row["p99_ms"], s["p99_ms"])
            p50s.setdefault(s["stage"], []).append((s["p50_ms"], s["items"]))
    capacity = wall_s * max(replicas, 1)
    out = []
    for name, row in merged.items():
        values = [(v, n) for v, n in p50s[name] if n]
        row["p50_ms"] = round(_weighted_median(values), 3) if values else 0.0
        row["share"] = round(row["busy_s"] / capacity, 4) if capacity > 0 else 0.0
        for key in ("busy_s", "starved_s", "backpressured_s"):
            row[key] = round(row[key], 4)
        out.append(
            {
                k: row[k]
                for k in ("stage", "items", "busy_s", "share", "p50_ms", "p99_ms", "starved_s", "backpressured_s")
            }
        )
    return out


def _weighted_median(values: list[tuple[float, int]]) -> float:
    values = sorted(values)
    weights = np.cumsum([n for _, n in values])
    return float(values[int(np.searchsorted(weights, weights[-1] / 2))][0])


def per_actor(
    results: list[Any], wall_s: float, counts: Callable[[Any], dict[str, int]], tokens: str, speed: tuple[str, str]
) -> list[dict[str, Any]]:
    """One row per actor (host:pid, so a restarted actor is a row of its own), for any task.

    `counts(result)` are the task's figures of a unit, summed per actor; `tokens` names the one
    whose share each actor gets, and `speed` = (column, figure) the figure per busy second.
    """
    actors: dict[str, dict[str, Any]] = {}
    t0 = min((r.started for r in results), default=0.0)
    for r in results:
        figures = counts(r)
        a = actors.setdefault(r.replica, {"device": r.replica, "units": 0, **dict.fromkeys(figures, 0)})
        a.setdefault("busy_s", 0.0)
        a.setdefault("last", t0)
        a["units"] += 1
        for key, value in figures.items():
            a[key] += value
        a["busy_s"] += r.finished - r.started
        a["last"] = max(a["last"], r.finished)
    total = sum(a[tokens] for a in actors.values()) or 1
    end = max((a["last"] for a in actors.values()), default=t0)
    column, figure = speed
    return [
        {
            **{k: v for k, v in a.items() if k not in ("busy_s", "last")},
            "token_share": round(a[tokens] / total, 4),
            "busy_s": round(a["busy_s"], 4),
            "busy_share": round(a["busy_s"] / wall_s, 4) if wall_s > 0 else 0.0,
            column: round(a[figure] / a["busy_s"], 3) if a["busy_s"] > 0 else 0.0,
            "finished_s": round(a["last"] - t0, 4),
            "idle_tail_s": round(end - a["last"], 4),
        }
        for a in actors.values()
    ]


def cluster_figures(actors: list[dict[str, Any]], replicas: int, speed: str) -> dict[str, Any]:
    """The cluster's line of a report: actors seen (restarts), and the slowest by `speed` per busy second."""
    slowest = min(actors, key=lambda d: d[speed], default=None)
    return {
        "replicas": replicas,
        "actors_seen": len(actors),
        "actor_restarts_seen": max(0, len(actors) - replicas),
        "slowest_actor": slowest["device"] if slowest else None,
        "busy_s_total": round(sum(d["busy_s"] for d in actors), 4),
    }
