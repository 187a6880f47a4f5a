"""The embedding run's report: totals, per-stage timing and the bottleneck; JSON with a schema_version,
and the tables a person reads on stderr."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from ..job.accounting import accounting_line
from ..obs.render import cluster_line, rows_table
from ..obs.report_json import JsonReport, ratio
from .quantize import Int8Check


@dataclass(slots=True)
class RunReport(JsonReport):
    rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    truncated_rows: int = 0
    rejects: dict[str, int] = field(default_factory=dict)  # reason -> rows
    rows_resumed: int = 0  # rows already committed (or checkpointed) by an interrupted run
    checkpoints: int = 0  # --commit-every: checkpoints this run wrote of windows not yet complete
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
    backend: str = ""  # the models that ran: native (hpcinfer's own) or transformers
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
    # --devices: breaker transitions (device, at_s, state, reason), and each restart after a device
    # fault (device, error, rows committed then: the rest was done on the devices left)
    device_faults: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    # --quantize int8|auto: what ran, and int8 against float32 on the job's first rows (quantize.py)
    quantize: dict[str, Any] = field(default_factory=dict)
    # --tp N (a decoder embedder): each rank's weights, RSS after loading and time in collectives
    tensor_parallel: list[dict[str, Any]] = field(default_factory=list)
    cpu_affinity: str = ""  # --cpu-affinity: which cores each kind of thread ran on (place/affinity.py)
    # The run over time (obs/timeline.py), the machine it ran on, and the HTML report written (if any)
    timeline: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    html_report: str = ""

    padding_efficiency = property(lambda self: ratio(self.real_tokens, self.padded_tokens, 1.0))
    rows_per_s = property(lambda self: ratio(self.rows, self.wall_s))
    tokens_per_s = property(lambda self: ratio(self.real_tokens, self.wall_s))
    DERIVED = (("padding_efficiency", 6), ("rows_per_s", 3), ("tokens_per_s", 3))

    def render(self, console: Console) -> None:
        """The summary, where the time went, the devices, the bottleneck (and the cluster, the rate)."""
        console.print(summary_table(self))
        console.print(stage_table(self))
        if len(self.devices) > 1:
            console.print(rows_table("per device", self.devices, DEVICE_COLUMNS))
        if self.bottleneck:  # NOTE: none is named for a run too short to have one (obs/timing.py)
            console.print(f"bottleneck: [bold]{self.bottleneck}[/bold] - {self.hint}")
        if self.cluster:
            console.print(cluster_line(self))
        if (line := saturation_line(self)) is not None:
            console.print(line)
        if self.quantize:
            console.print(Int8Check(**self.quantize).line())
        for r in self.tensor_parallel:
            console.print(
                f"tensor-parallel rank {r['rank']} ({r['device']}): weights {r['weight_bytes'] / 2**20:,.1f} MiB, "
                f"RSS after load {r['rss_after_load_bytes'] / 2**20:,.0f} MiB, collectives "
                f"{r['collective_s']:,.2f} s ({r['collective_calls']:,} calls), batches {r['steps']:,}"
            )
        if self.cpu_affinity:
            console.print(f"cpu affinity: {self.cpu_affinity}")
        for t in self.device_faults:
            console.print(f"device {t['device']} at {t['at_s']:.1f} s: {t['state']}: {t['reason']}")
        for r in self.restarts:
            where = f"from {r['committed_rows']:,} committed rows"
            console.print(f"restarted after {r['device']} failed ({r['error']}) {where}")


def weights_note(report: RunReport) -> str:
    if report.quantize.get("chosen") == "int8":
        return f", int8 weights on {report.quantize['engine']}"
    return ""


def summary_table(report: RunReport) -> Table:
    table = Table(title="hpcinfer run", show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    for name, value in (
        ("rows written", f"{report.rows:,}"),
        ("rows resumed", f"{report.rows_resumed:,}"),
        ("real tokens", f"{report.real_tokens:,}"),
        ("padded tokens", f"{report.padded_tokens:,}"),
        ("padding efficiency", f"{report.padding_efficiency:.2%}"),
        ("truncated rows", f"{report.truncated_rows:,}"),
        ("rejected rows", ", ".join(f"{k} {v:,}" for k, v in report.rejects.items()) or "0"),
        ("accounting", accounting_line(report.accounting) + " (balanced)" if report.accounting else "-"),
        ("out-of-memory splits", f"{report.oom_splits:,}"),
        ("batches", f"{report.batches:,}"),
        ("wall time", f"{report.wall_s:.2f} s"),
        ("rows/s", f"{report.rows_per_s:,.1f}"),
        ("tokens/s", f"{report.tokens_per_s:,.0f}"),
        ("device", f"{report.device} ({report.dtype}{weights_note(report)})"),
    ):
        table.add_row(name, value)
    if report.batch_latency_ms:
        table.add_row("batch latency p50/p99", _ms(report.batch_latency_ms, ("p50", "p99")))
    if report.arrivals:
        a = report.arrivals
        table.add_row("request latency p50/p90/p99", _ms(a["latency_ms"], ("p50", "p90", "p99")))
        table.add_row("offered / achieved rate", f"{a['offered_rate']:,.1f} / {a['achieved_rate']:,.1f} rows/s")
    return table


def _ms(values: dict[str, float], keys: tuple[str, ...]) -> str:
    return " / ".join(f"{values[k]:,.1f}" for k in keys) + " ms"


def saturation_line(report: RunReport) -> str | None:
    a = report.arrivals
    if not a:
        return None
    if a["saturated"]:
        return (
            f"[bold red]saturated[/bold red]: requests arrived at {a['offered_rate']:,.1f}/s but were served at "
            f"{a['achieved_rate']:,.1f}/s, so they queued and latency grew; lower --rate or see the bottleneck"
        )
    return f"kept up with --rate {a['rate']:g}: served {a['achieved_rate']:,.1f} of {a['offered_rate']:,.1f} rows/s"


def stage_table(report: RunReport) -> Table:
    table = Table(title="where the time went", title_justify="left")
    for col in ("stage", "items", "busy s", "share", "p50 ms", "p99 ms", "starved s", "back-pressured s"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in report.stages:
        style = "bold yellow" if s["stage"] == report.bottleneck else None
        table.add_row(
            s["stage"],
            str(s["items"]),
            f"{s['busy_s']:.3f}",
            f"{s['share']:.1%}",
            f"{s['p50_ms']:.2f}",
            f"{s['p99_ms']:.2f}",
            f"{s['starved_s']:.3f}",
            f"{s['backpressured_s']:.3f}",
            style=style,
        )
    return table


DEVICE_COLUMNS = (
    ("device", "device", ""),
    ("batches", "batches", ","),
    ("rows", "rows", ","),
    ("tokens", "tokens", ","),
    ("token share", "token_share", ".1%"),
    ("busy s", "busy_s", ".3f"),
    ("busy share", "busy_share", ".1%"),
    ("idle tail s", "idle_tail_s", ".3f"),
)
