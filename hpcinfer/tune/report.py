"""`hpcinfer tune --report FILE / --report-html FILE`: the trials as JSON, and the page made of it
(obs/html/: each trial's throughput and latency, the chosen one marked, the Pareto front under a
latency limit). `hpcinfer report` makes the same page from the JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..config import RunConfig, flatten
from ..obs.report_json import SCHEMA_VERSION
from .search import Goal


def tune_report(result: Any, base: RunConfig, machine: dict[str, Any]) -> dict[str, Any]:
    """`result`: a TuneResult (command.py)."""
    goal: Goal = result.goal
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "tune",
        "model": base.model,
        "device": result.device,
        "sample": result.sample.describe() if hasattr(result.sample, "describe") else str(result.sample),
        "goal": asdict(goal),
        "speed": "tokens_per_s" if goal.objective == "tokens" else "rows_per_s",
        "trials": [asdict(t) for t in result.search.trials],
        "best": result.best.index,
        "default": result.default.index,
        "config": flatten(base),
        "machine": machine,
    }


def write_tune_reports(report: dict[str, Any], json_path: str | None, html_path: str | None) -> None:
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2, default=str)
            fh.write("\n")
    if html_path:
        from ..obs.html.page import write_report_html

        write_report_html(report, html_path)
