"""Per-stage timing: busy, starved (waiting on the inbox), back-pressured (waiting on the outbox),
per-item durations, and every span for the trace. Thread-safe; clocks are perf_counter_ns.

The spans are written as Chrome trace events (`write_trace`: opens in Perfetto or
chrome://tracing), one complete event per span.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .meter import COUNTER, Meter

HOST_STAGES = ("read", "tokenize", "decode", "plan", "stage", "execute", "write")
DEVICE_STAGES = ("h2d", "compute", "d2h")
REPORT_ORDER = ("read", "tokenize", "decode", "plan", "stage", "h2d", "execute", "compute", "d2h", "write")


@dataclass(slots=True)
class Span:
    stage: str
    start_ns: int
    end_ns: int
    track: str  # thread or stream name
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StageClock:
    busy_ns: int = 0
    starved_ns: int = 0
    blocked_ns: int = 0
    workers: int = 1
    durations_ns: list[int] = field(default_factory=list)


class Timings:
    """Collects what every stage spent; `keep_spans` keeps each span for --trace."""

    def __init__(self, keep_spans: bool = False) -> None:
        self._lock = threading.Lock()
        self.clocks: dict[str, StageClock] = {name: StageClock() for name in REPORT_ORDER}
        self.spans: list[Span] = []
        self.keep_spans = keep_spans

    def busy(self, stage: str, start_ns: int, end_ns: int, track: str, **args: Any) -> None:
        with self._lock:
            clock = self._clock(stage)
            clock.busy_ns += end_ns - start_ns
            clock.durations_ns.append(end_ns - start_ns)
            if self.keep_spans:
                self.spans.append(Span(stage, start_ns, end_ns, track, args))

    def starved(self, stage: str, ns: int) -> None:
        with self._lock:
            self._clock(stage).starved_ns += ns

    def blocked(self, stage: str, ns: int) -> None:
        with self._lock:
            self._clock(stage).blocked_ns += ns

    def set_workers(self, stage: str, workers: int) -> None:
        self._clock(stage).workers = workers

    def watch(self, meter: Meter) -> None:
        """Each reported stage's busy seconds, read live (the metrics endpoint, the report's timeline)."""
        for name in REPORT_ORDER:
            meter.probe(f"stage_busy_s.{name}", lambda c=self.clocks[name]: c.busy_ns / 1e9, COUNTER, carry=True)

    def workers(self) -> dict[str, int]:
        return {name: self.clocks[name].workers for name in REPORT_ORDER}

    def _clock(self, stage: str) -> StageClock:
        """A stage outside the report's order (the dispatch of several devices) is kept, not shown."""
        return self.clocks.setdefault(stage, StageClock())

    def summary(self, wall_s: float) -> list[dict[str, Any]]:
        rows = []
        for name in REPORT_ORDER:
            c = self.clocks[name]
            d = np.asarray(c.durations_ns, dtype=np.float64) / 1e6
            busy = c.busy_ns / 1e9
            rows.append(
                {
                    "stage": name,
                    "items": len(c.durations_ns),
                    "busy_s": round(busy, 4),
                    "share": round(busy / c.workers / wall_s, 4) if wall_s > 0 else 0.0,
                    "p50_ms": round(float(np.percentile(d, 50)), 3) if len(d) else 0.0,
                    "p99_ms": round(float(np.percentile(d, 99)), 3) if len(d) else 0.0,
                    "starved_s": round(c.starved_ns / 1e9, 4),
                    "backpressured_s": round(c.blocked_ns / 1e9, 4),
                }
            )
        return rows


HINTS = {
    "read": "read-bound: parsing input is the limit; convert JSONL to Parquet or read fewer columns",
    "tokenize": "tokenize-bound: raise --tokenize-threads",
    "decode": "decode-bound: decoding and resizing images is the limit; raise --tokenize-threads (the decode "
    "threads), or store the images smaller",
    "plan": "plan-bound: lower --sort-window",
    "stage": "stage-bound: raise --staging-buffers or --max-batch-tokens (fewer, larger copies)",
    "h2d": "copy-bound: raise --staging-buffers so copies overlap compute",
    "execute": "launch-bound: the host cannot issue work fast enough; try --cuda-graphs or a larger --max-batch-tokens",
    "compute": "compute-bound: the model itself is the limit, as it should be; on a GPU try --dtype bfloat16 "
    "or --cuda-graphs",
    "d2h": "copy-bound on results: raise --streams so result copies overlap compute",
    "write": "write-bound: write Parquet instead of JSONL",
}
# The output is Parquet already: what is left is where it goes and how often a part is committed.
PARQUET_WRITE_HINT = "write-bound: the output is Parquet already; write it to faster storage, or raise --sort-window"
MIN_WALL_S = 2.0  # a shorter run's shares are start-up and warm-up, not a steady state: no bottleneck named


def bottleneck(
    stages: list[dict[str, Any]],
    synchronous_device: bool,
    *,
    wall_s: float | None = None,
    output_format: str | None = None,
) -> tuple[str, str]:
    """The stage with the highest busy share, with a one-line hint (never advice the run follows
    already: `output_format`). A run shorter than MIN_WALL_S (`wall_s`) names none: ("", why).

    NOTE: on a synchronous device the execute stage's time *is* the compute time; counting both
    would name the same work twice, so only `compute` competes.
    """
    if wall_s is not None and wall_s < MIN_WALL_S:
        return "", f"the run took {wall_s:.2f} s, too short to name a bottleneck"
    candidates = [s for s in stages if not (synchronous_device and s["stage"] == "execute")]
    if not candidates or max(s["share"] for s in candidates) == 0:
        return "none", "no work was timed"
    top = max(candidates, key=lambda s: s["share"])
    if top["stage"] == "write" and output_format == "parquet":
        return "write", PARQUET_WRITE_HINT
    return top["stage"], HINTS[top["stage"]]


def write_trace(spans: list[Span], path: str) -> None:
    origin = min((s.start_ns for s in spans), default=0)
    tracks: dict[str, int] = {}
    events = []
    for s in sorted(spans, key=lambda s: s.start_ns):
        tid = tracks.setdefault(s.track, len(tracks) + 1)
        events.append(
            {
                "name": s.stage,
                "cat": "device" if s.track.startswith(("copy", "compute")) else "host",
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": (s.start_ns - origin) / 1e3,
                "dur": max(s.end_ns - s.start_ns, 0) / 1e3,
                "args": s.args,
            }
        )
    for track, tid in tracks.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}})
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
