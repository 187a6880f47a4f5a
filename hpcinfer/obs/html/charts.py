"""The HTML report's charts of a run (Bokeh figures), from its JSON report: throughput over time with
the commits marked, where the time went, and for generation the engine's queues, KV pool, prefix
cache and latency distributions; several devices add their lines, shares and breaker spans.

Each chart is a `Chart(key, title, figure)`; the page (page.py) lays them out, and the figure's
name is `chart:KEY`, which the browser test looks up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bokeh.models import ColumnDataSource, HoverTool, Span
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from .series import breaker_spans, column, commit_times, gauge, names, rate, shares

WIDTH, HEIGHT = 900, 260
BREAKER_COLOURS = {"open": "#d62728", "half-open": "#ff7f0e"}


@dataclass(frozen=True, slots=True)
class Chart:
    key: str
    title: str
    figure: Any
    note: str = ""


def chart_figure(key: str, title: str, x_label: str = "seconds since the job started", **kw: Any) -> Any:
    """A chart's figure: named `chart:KEY` (the browser test finds it by that), the page's size and tools."""
    fig = figure(name=f"chart:{key}", title=title, width=WIDTH, height=HEIGHT, tools="pan,box_zoom,reset,save", **kw)
    fig.xaxis.axis_label = x_label
    fig.toolbar.logo = None
    return fig


def _lines(fig: Any, lines: dict[str, tuple[list[float], list[float]]], y_label: str) -> None:
    for colour, (label, (ts, vs)) in zip(Category10_10 * 4, lines.items(), strict=False):
        source = ColumnDataSource({"t": ts, "v": vs})
        fig.line("t", "v", source=source, legend_label=label, color=colour, line_width=2)
    fig.yaxis.axis_label = y_label
    fig.add_tools(HoverTool(tooltips=[("t", "@t{0.0} s"), (y_label, "@v{0,0.00}")]))
    if fig.legend:
        fig.add_layout(fig.legend[0], "right")
        fig.legend.click_policy = "hide"


def _commit_marks(fig: Any, timeline: dict[str, Any]) -> None:
    """Window commits as ticks along the x axis (a glyph, so each is counted and hoverable)."""
    times = commit_times(timeline)
    if times:
        fig.scatter(times, [0] * len(times), marker="triangle", size=7, color="#555555", legend_label="commit")


def throughput(report: dict[str, Any], tokens: list[str]) -> list[Chart]:
    tl = report["timeline"]
    rows = chart_figure("rows_per_s", "rows/s over time")
    finished = "rows_finished" if "rows_finished" in tl.get("series", {}) else "rows.done"
    _lines(rows, {"rows/s": rate(tl, finished)}, "rows/s")
    _commit_marks(rows, tl)
    toks = chart_figure("tokens_per_s", "tokens/s over time")
    if "step_tokens.decode" in tl.get("series", {}):  # generation: as the engines step, not as sequences finish
        lines = {f"{k} tokens/s": rate(tl, f"step_tokens.{k}") for k in ("prefill", "decode")}
    else:
        lines = {f"{k} tokens/s": rate(tl, f"tokens.{k}") for k in tokens}
    _lines(toks, lines, "tokens/s")
    _commit_marks(toks, tl)
    return [Chart("rows_per_s", "Rows per second", rows), Chart("tokens_per_s", "Tokens per second", toks)]


def busy_shares(key: str, title: str, parts: dict[str, tuple[list[float], list[float]]], note: str) -> Chart | None:
    """Each part's share of wall time, stacked (a part busy on several workers at once can exceed 1)."""
    if not parts:
        return None
    ts = max((p[0] for p in parts.values()), key=len)
    data: dict[str, list[float]] = {"t": ts}
    for label, (pts, vs) in parts.items():
        at = dict(zip(pts, vs, strict=True))
        data[label] = [max(0.0, at.get(t, 0.0)) for t in ts]
    labels = list(parts)
    fig = chart_figure(key, title)
    fig.varea_stack(
        labels, x="t", source=ColumnDataSource(data), color=Category10_10[: len(labels)], legend_label=labels
    )
    fig.yaxis.axis_label = "busy share of wall time"
    fig.add_layout(fig.legend[0], "right")
    return Chart(key, title, fig, note)


def stages(report: dict[str, Any]) -> Chart | None:
    tl = report["timeline"]
    parts = shares(tl, "stage_busy_s", tl.get("facts", {}).get("stage_workers"))
    if all(d.strip().startswith("cpu") for d in str(report.get("device", "")).split(",")):
        parts.pop("execute", None)  # NOTE: on a CPU, execute's time is compute's (obs/timing.py's bottleneck)
    note = f"bottleneck: {report['bottleneck']} - {report.get('hint', '')}" if report.get("bottleneck") else ""
    return busy_shares("stage_busy", "Per-stage busy share over time", parts, note)


def step_parts(report: dict[str, Any]) -> Chart | None:
    split = report.get("step_time_split") or {}
    top = max(split, key=split.get) if split and any(split.values()) else ""
    note = f"most of each step: {top} ({split[top]:,.2f} s of {sum(split.values()):,.2f} s)" if top else ""
    parts = shares(report["timeline"], "step_busy_s")
    total: dict[float, float] = {}
    for ts, vs in parts.values():
        for t, v in zip(ts, vs, strict=True):
            total[t] = total.get(t, 0.0) + v
    # NOTE: each part's share of the step time in each interval (the parts overlap with --ahead, so
    # their sum is not wall time)
    fractions = {k: (ts, [v / total[t] if total[t] else 0.0 for t, v in zip(ts, vs, strict=True)])
                 for k, (ts, vs) in parts.items()}  # fmt: skip
    chart = busy_shares("step_busy", "Where engine steps spent their time", fractions, note)
    if chart is not None:
        chart.figure.yaxis.axis_label = "share of step time"
    return chart


def engine(report: dict[str, Any]) -> list[Chart]:
    tl = report["timeline"]
    out = []
    if "running" in tl.get("series", {}):
        seqs = chart_figure("sequences", "Running and waiting sequences")
        _lines(seqs, {"running": gauge(tl, "running"), "waiting": gauge(tl, "waiting")}, "sequences")
        out.append(Chart("sequences", "Running and waiting sequences", seqs))
    occ = chart_figure("occupancy", "Batch occupancy (sequences per step / max-num-seqs)")
    _lines(occ, {"occupancy": rate(tl, "occupancy_sum", per="steps")}, "occupancy")
    out.append(Chart("occupancy", "Batch occupancy", occ))
    if "kv_blocks_used" in tl.get("series", {}):
        kv = chart_figure("kv_blocks", "KV cache blocks used and the pool")
        _lines(kv, {"used": gauge(tl, "kv_blocks_used"), "pool": gauge(tl, "kv_blocks_total")}, "blocks")
        out.append(Chart("kv_blocks", "KV cache blocks", kv))
    pre = chart_figure("preemptions", "Preemptions (cumulative)")
    _lines(pre, {"preemptions": gauge(tl, "preemptions")}, "preemptions")
    out.append(Chart("preemptions", "Preemptions", pre))
    if report.get("prefix_cache"):
        hit = chart_figure("prefix_hits", "Prefix-cache hit rate (cached / prompt tokens, per interval)")
        _lines(hit, {"hit rate": rate(tl, "prefix_cache_hit_tokens", per="tokens.prompt")}, "hit rate")
        out.append(Chart("prefix_hits", "Prefix-cache hit rate", hit))
    return out


def latency_histogram(key: str, title: str, hist: dict[str, Any], marks: dict[str, float]) -> Chart | None:
    """A log-binned histogram with its p50 and p99 (from the report's percentiles) marked."""
    if not hist:
        return None
    edges = hist["edges_ms"]
    fig = chart_figure(key, title, x_label="milliseconds", x_axis_type="log")
    source = ColumnDataSource({"left": edges[:-1], "right": edges[1:], "count": hist["counts"]})
    fig.quad(left="left", right="right", top="count", bottom=0, source=source, fill_alpha=0.6)
    fig.yaxis.axis_label = "requests"
    for name, colour in (("p50_ms", "#2ca02c"), ("p99_ms", "#d62728")):
        if name in marks:
            fig.add_layout(Span(location=marks[name], dimension="height", line_color=colour, line_dash="dashed"))
    note = ", ".join(f"{k.removesuffix('_ms')} {v:,.3f} ms" for k, v in marks.items() if k in ("p50_ms", "p99_ms"))
    return Chart(key, title, fig, note)


def finish_reasons(report: dict[str, Any]) -> Chart | None:
    reasons = report.get("finish_reasons") or {}
    if not reasons:
        return None
    labels = sorted(reasons)
    fig = figure(
        name="chart:finish_reasons",
        title="Finish reasons",
        x_range=labels,
        width=WIDTH // 2,
        height=HEIGHT,
        tools="save",
    )
    fig.vbar(x=labels, top=[reasons[k] for k in labels], width=0.7)
    fig.toolbar.logo = None
    return Chart("finish_reasons", "Finish reasons", fig)


def devices(report: dict[str, Any]) -> list[Chart]:
    """Several devices (or replicas): each one's rows/s, its token share, and its breaker's spans."""
    tl, per = report["timeline"], report.get("devices") or []
    labels = names(tl, "device_rows")
    if len(labels) < 2 and len(per) < 2:
        return []
    out = []
    if labels:
        fig = chart_figure("device_rows", "Rows/s per device")
        _lines(fig, {label: rate(tl, f"device_rows.{label}") for label in labels}, "rows/s")
        out.append(Chart("device_rows", "Rows per second, per device", fig))
    shown, token_share = [d["device"] for d in per], [d.get("token_share", 0.0) for d in per]
    if not per:  # NOTE: Ray replicas: their shares of the tokens the driver committed
        last = {label: next((v for v in reversed(column(tl, f"device_tokens.{label}")) if v is not None), 0.0)
                for label in labels}  # fmt: skip
        total = sum(last.values()) or 1.0
        shown, token_share = list(last), [v / total for v in last.values()]
    share = chart_figure("token_share", "Token share per device", x_label="device", x_range=shown)
    share.vbar(x=shown, top=token_share, width=0.6)
    out.append(Chart("token_share", "Token share per device", share))
    end = tl["t"][-1] if tl.get("t") else 0.0
    spans = breaker_spans(tl, end)
    if spans:
        ys = sorted({s["device"] for s in spans})
        fig = chart_figure("breakers", "Circuit breakers out of the closed state", y_range=ys)
        data = {k: [s[k] for s in spans] for k in ("device", "state", "start", "end")}
        data["colour"] = [BREAKER_COLOURS.get(s, "#999999") for s in data["state"]]
        fig.hbar(
            y="device",
            left="start",
            right="end",
            height=0.5,
            color="colour",
            legend_field="state",
            source=ColumnDataSource(data),
        )
        out.append(Chart("breakers", "Breaker open and half-open spans", fig))
    return out


def run_charts(report: dict[str, Any]) -> list[Chart]:
    generation = report.get("task") == "generate" or report.get("config", {}).get("task") == "generate"
    tokens = ["prompt", "completion"] if generation else ["input"]
    charts: list[Chart | None] = [*throughput(report, tokens)]
    if generation:
        charts += [step_parts(report), *engine(report)]
        hist = report.get("latency_histograms") or {}
        charts.append(latency_histogram("ttft", "Time to first token", hist.get("ttft", {}), report.get("ttft", {})))
        charts.append(latency_histogram("tpot", "Time per output token", hist.get("tpot", {}), report.get("tpot", {})))
        charts.append(finish_reasons(report))
    else:
        charts.append(stages(report))
    charts += devices(report)
    return [c for c in charts if c is not None]
