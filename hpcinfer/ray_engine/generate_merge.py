"""Per-unit figures of the generation replicas -> one generation report of the whole job.

Tokens, steps and engine seconds add up; the KV pool is one actor's (every actor sizes its own the
same way), its peak the highest; TTFT, time per output token and latency are percentiles over
every answer of every unit. Each actor gets a row of the per-actor table (windows, rows, generated
tokens and their share, busy seconds and share of the wall time, generated tokens per busy second,
idle tail), and `cluster` names the slowest actor (fewest generated tokens per busy second).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from ..obs.render import cluster_line
from ..tasks.generate.report import GenerateReport, percentiles
from .generate_replica import GenerateUnitResult
from .merge import cluster_figures

_ADDED = (
    "prompt_tokens",
    "completion_tokens",
    "prompt_tokens_cached",
    "steps",
    "prefill_tokens",
    "decode_tokens",
    "preemptions",
    "prefill_tokens_saved",
    "kv_evictions",
)
_SPLIT = (
    ("model", "model_s"),
    ("attention_gather", "attention_gather_s"),
    ("sampling", "sampling_s"),
    ("host", "host_s"),
)


@dataclass(slots=True)
class ClusterGenerateReport(GenerateReport):
    """The generation report, plus a row per Ray actor and the cluster's figures."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    cluster: dict[str, Any] = field(default_factory=dict)

    def _device_rows(self, table: Table) -> None:
        """The actors get a table of their own (below), not the several-device rows."""

    def render(self, console: Console) -> None:
        GenerateReport.render(self, console)
        table = Table(title="per actor (tokens generated; tok/s of busy time)", title_justify="left")
        for col in ("actor", "windows", "rows", "tokens", "share", "busy s", "busy", "tok/s", "idle s"):
            table.add_column(col, justify="left" if col == "actor" else "right")
        for d in self.devices:
            table.add_row(
                d["device"],
                f"{d['units']:,}",
                f"{d['rows']:,}",
                f"{d['generated_tokens']:,}",
                f"{d['token_share']:.1%}",
                f"{d['busy_s']:.3f}",
                f"{d['busy_share']:.1%}",
                f"{d['tokens_per_busy_s']:,.1f}",
                f"{d['idle_tail_s']:.3f}",
            )
        console.print(table)
        if self.cluster:
            console.print(cluster_line(self))  # type: ignore[arg-type]


def merge_generate_reports(results: list[GenerateUnitResult], wall_s: float, replicas: int) -> ClusterGenerateReport:
    """The totals and tables of a cluster run; the caller adds rows, accounting, rejects and identity."""
    report = ClusterGenerateReport(wall_s=wall_s)
    occupancy = 0.0
    split = dict.fromkeys((name for name, _ in _SPLIT), 0.0)
    ttft: list[float] = []
    tpot: list[float] = []
    latency: dict[int, list[float]] = {}
    for r in results:
        f = r.figures
        for key in _ADDED:
            setattr(report, key, getattr(report, key) + f.get(key, 0))
        for reason, n in f.get("finish_reasons", {}).items():
            report.finish_reasons[reason] = report.finish_reasons.get(reason, 0) + n
        occupancy += f.get("occupancy_sum", 0.0)
        for name, key in _SPLIT:
            split[name] += f.get(key, 0.0)
        report.kv_blocks = max(report.kv_blocks, f.get("kv_blocks", 0))
        report.kv_block_size = max(report.kv_block_size, f.get("kv_block_size", 0))
        report.kv_cache_bytes = max(report.kv_cache_bytes, f.get("kv_cache_bytes", 0))
        report.peak_kv_blocks = max(report.peak_kv_blocks, f.get("peak_kv_blocks", 0))
        ttft += r.ttft
        tpot += r.tpot
        for priority, values in r.latency.items():
            latency.setdefault(priority, []).extend(values)
    report.finish_reasons = dict(sorted(report.finish_reasons.items()))
    report.mean_occupancy = round(occupancy / report.steps, 4) if report.steps else 0.0
    report.step_time_split = {k: round(v, 4) for k, v in split.items()}
    report.ttft, report.tpot = percentiles(ttft), percentiles(tpot)
    report.latency_by_priority = {str(p): percentiles(v) for p, v in sorted(latency.items(), reverse=True)}
    report.devices = per_actor(results, wall_s)
    report.cluster = cluster_figures(report.devices, replicas, "tokens_per_busy_s")
    return report


def per_actor(results: list[GenerateUnitResult], wall_s: float) -> list[dict[str, Any]]:
    """One row per actor (host:pid, so a restarted actor is a row of its own)."""
    actors: dict[str, dict[str, Any]] = {}
    t0 = min((r.started for r in results), default=0.0)
    for r in results:
        a = actors.setdefault(
            r.replica, {"device": r.replica, "units": 0, "rows": 0, "generated_tokens": 0, "busy_s": 0.0, "last": t0}
        )
        a["units"] += 1
        a["rows"] += r.figures.get("rows", 0)
        a["generated_tokens"] += r.figures.get("completion_tokens", 0)
        a["busy_s"] += r.finished - r.started
        a["last"] = max(a["last"], r.finished)
    total = sum(a["generated_tokens"] for a in actors.values()) or 1
    end = max((a["last"] for a in actors.values()), default=t0)
    return [
        {
            **{k: a[k] for k in ("device", "units", "rows", "generated_tokens")},
            "token_share": round(a["generated_tokens"] / total, 4),
            "busy_s": round(a["busy_s"], 4),
            "busy_share": round(a["busy_s"] / wall_s, 4) if wall_s > 0 else 0.0,
            "tokens_per_busy_s": round(a["generated_tokens"] / a["busy_s"], 3) if a["busy_s"] > 0 else 0.0,
            "finished_s": round(a["last"] - t0, 4),
            "idle_tail_s": round(end - a["last"], 4),
        }
        for a in actors.values()
    ]
