"""Chrome trace event format (opens in Perfetto / chrome://tracing): one complete event per span."""

from __future__ import annotations

import json

from .timing import Span


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
