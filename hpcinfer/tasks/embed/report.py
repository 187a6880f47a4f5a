"""The run report: totals, per-stage timing and the bottleneck; JSON with a schema_version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...obs.report_json import JsonReport, ratio


@dataclass(slots=True)
class RunReport(JsonReport):
    rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    truncated_rows: int = 0
    rejects: dict[str, int] = field(default_factory=dict)  # reason -> rows
    rows_resumed: int = 0  # rows already committed by an interrupted run
    # rows read = written + rejected + resumed, per input file (see accounting.py)
    accounting: dict[str, Any] = field(default_factory=dict)
    oom_splits: int = 0
    final_max_batch_tokens: int = 0
    batches: int = 0
    windows: int = 0
    wall_s: float = 0.0
    device: str = ""
    dtype: str = ""
    model: str = ""
    output: str = ""
    stages: list[dict[str, Any]] = field(default_factory=list)
    bottleneck: str = ""
    hint: str = ""
    peak_device_memory_bytes: int | None = None
    devices: list[dict[str, Any]] = field(default_factory=list)  # per device: tokens, busy share, idle tail
    batch_latency_ms: dict[str, float] = field(default_factory=dict)  # batch staged -> its results written
    # Under --rate: per-request latency (arrival -> committed), offered/achieved rate, saturated.
    arrivals: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    # --engine ray: replicas, actors seen, the slowest actor, Ray's spill and failed-task counts
    cluster: dict[str, Any] = field(default_factory=dict)

    padding_efficiency = property(lambda self: ratio(self.real_tokens, self.padded_tokens, 1.0))
    rows_per_s = property(lambda self: ratio(self.rows, self.wall_s))
    tokens_per_s = property(lambda self: ratio(self.real_tokens, self.wall_s))
    DERIVED = (("padding_efficiency", 6), ("rows_per_s", 3), ("tokens_per_s", 3))
