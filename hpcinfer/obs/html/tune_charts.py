"""The HTML report's charts of a `hpcinfer tune`: each trial's throughput and latency, the chosen
trial marked, and the Pareto front (the trials no other beats on both) under a latency limit."""

from __future__ import annotations

from typing import Any

from bokeh.models import ColumnDataSource, HoverTool, Span

from .charts import Chart, chart_figure

STATUS_COLOURS = {"ok": "#1f77b4", "over-limit": "#ff7f0e", "infeasible": "#7f7f7f"}


def pareto_front(trials: list[dict[str, Any]], speed: str) -> list[dict[str, Any]]:
    """The measured trials no other is at least as fast as and at least as quick (p99) as, with one
    of the two strictly better; sorted by latency."""
    ok = [t for t in trials if t["status"] != "infeasible"]
    front = [
        t
        for t in ok
        if not any(
            o is not t
            and o[speed] >= t[speed]
            and o["p99_ms"] <= t["p99_ms"]
            and (o[speed] > t[speed] or o["p99_ms"] < t["p99_ms"])
            for o in ok
        )
    ]
    return sorted(front, key=lambda t: t["p99_ms"])


def tune_charts(report: dict[str, Any]) -> list[Chart]:
    trials, speed = report["trials"], report["speed"]
    best = report["best"]
    unit = "tokens/s" if speed == "tokens_per_s" else "rows/s"
    data = {
        "trial": [t["index"] for t in trials],
        "speed": [t[speed] for t in trials],
        "p99": [t["p99_ms"] for t in trials],
        "status": [t["status"] for t in trials],
        "knobs": [", ".join(f"{k}={v}" for k, v in t["params"].items()) for t in trials],
        "colour": ["#2ca02c" if t["index"] == best else STATUS_COLOURS.get(t["status"], "#1f77b4") for t in trials],
        "size": [14 if t["index"] == best else 8 for t in trials],
    }
    source = ColumnDataSource(data)
    hover = HoverTool(
        tooltips=[
            ("trial", "@trial"),
            (unit, "@speed{0,0.0}"),
            ("p99", "@p99{0,0.00} ms"),
            ("status", "@status"),
            ("knobs", "@knobs"),
        ]
    )
    bars = chart_figure("trial_speed", f"Each trial's {unit} (the chosen one in green)", x_label="trial")
    bars.vbar(x="trial", top="speed", width=0.7, color="colour", source=source)
    bars.add_tools(hover)
    bars.yaxis.axis_label = unit
    scatter = chart_figure("trial_latency", f"{unit} against p99 latency", x_label="p99 latency (ms)")
    scatter.scatter("p99", "speed", size="size", color="colour", source=source)
    scatter.add_tools(HoverTool(tooltips=hover.tooltips))
    scatter.yaxis.axis_label = unit
    limit = report.get("goal", {}).get("max_p99_ms")
    charts = [
        Chart("trial_speed", f"Trials: {unit}", bars),
        Chart("trial_latency", "Trials: speed and latency", scatter),
    ]
    if limit is not None:
        front = pareto_front(trials, speed)
        scatter.line(
            [t["p99_ms"] for t in front],
            [t[speed] for t in front],
            color="#9467bd",
            line_width=2,
            legend_label="Pareto front",
        )
        scatter.add_layout(Span(location=limit, dimension="height", line_color="#d62728", line_dash="dashed"))
        charts[1] = Chart(
            "trial_latency",
            "Trials: speed and latency",
            scatter,
            f"p99 limit {limit:g} ms (dashed); the Pareto front joins the trials no other beats on both",
        )
    return charts
