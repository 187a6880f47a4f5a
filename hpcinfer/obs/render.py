"""Human output on stderr: the summary table and the per-stage timing table (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..job.accounting import accounting_line
from ..tasks.embed.report import RunReport


def summary_table(report: RunReport) -> Table:
    table = Table(title="hpcinfer run", show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    for name, value in (
        ("rows", f"{report.rows:,}"),
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
        ("device", f"{report.device} ({report.dtype})"),
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


def device_table(report: RunReport) -> Table:
    table = Table(title="per device", title_justify="left")
    for col in ("device", "batches", "rows", "tokens", "token share", "busy s", "busy share", "idle tail s"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for d in report.devices:
        table.add_row(
            d["device"],
            f"{d['batches']:,}",
            f"{d['rows']:,}",
            f"{d['tokens']:,}",
            f"{d['token_share']:.1%}",
            f"{d['busy_s']:.3f}",
            f"{d['busy_share']:.1%}",
            f"{d['idle_tail_s']:.3f}",
        )
    return table


def render(report: RunReport, console: Console) -> None:
    if getattr(report, "task", "embed") == "generate":  # a generation run renders its own report
        return report.render(console)  # type: ignore[attr-defined]
    console.print(summary_table(report))
    console.print(stage_table(report))
    if len(report.devices) > 1:
        console.print(device_table(report))
    console.print(f"bottleneck: [bold]{report.bottleneck}[/bold] - {report.hint}")
    if report.cluster:
        console.print(cluster_line(report))
    if (line := saturation_line(report)) is not None:
        console.print(line)


def cluster_line(report: RunReport) -> str:
    """The Ray run in one line: replicas, the slowest actor, restarts, Ray's spill and failed tasks."""
    c = report.cluster
    parts = [f"ray: {c['replicas']} replicas", f"slowest actor {c['slowest_actor']}"]
    parts.append(f"actor restarts seen {c['actor_restarts_seen']}")
    if "tasks_failed" in c:
        parts.append(f"failed tasks {c['tasks_failed']} (retried)")
    if "object_store_spilled_bytes" in c:
        parts.append(f"object store spilled {c['object_store_spilled_bytes'] / 2**20:,.1f} MiB")
    return ", ".join(parts)
