"""`hpcinfer tune --report FILE / --report-html FILE`: the trials as JSON, and the page made of it
(obs/html/: each trial's throughput and latency, the chosen one marked, the Pareto front under a
latency limit). `hpcinfer report` makes the same page from the JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import RunConfig, flatten
from ..errors import ConfigError, OutputError
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


def check_report_paths(json_path: str | None, html_path: str | None) -> None:
    """Before any trial: a report path whose folder does not exist is a one-line error."""
    for flag, path in (("--report", json_path), ("--report-html", html_path)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ConfigError(f"{flag}: the folder {Path(path).parent} does not exist", path=path)


def write_tune_reports(report: dict[str, Any], json_path: str | None, html_path: str | None) -> None:
    try:
        if json_path:
            with open(json_path, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=2, default=str)
                fh.write("\n")
        if html_path:
            from ..obs.html.page import write_report_html

            write_report_html(report, html_path)
    except OSError as exc:
        raise OutputError(f"the trials ran, but their report could not be written: {exc.strerror or exc}",
                          path=exc.filename or json_path or html_path) from None  # fmt: skip
