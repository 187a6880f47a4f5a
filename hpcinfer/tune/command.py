"""`hpcinfer tune`: sample the input, search the knobs, show every trial, write the winner down.

One harness for every task: the options, the goal, the CSV of trials and the recipe are written
here; what is sampled, which knobs are searched and how a trial runs are the task's (a
`TuneTask`: pipeline/tuning.py, tasks/generate/tuning.py, handed out by the task's `tuning()`, registry.py).
"""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from ..config import RunConfig
from ..errors import ConfigError
from ..recipes import dump_recipe
from .options import TuneOptions
from .search import Goal, OnSample, OnTrial, Search, Trial

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)

__all__ = ["TuneOptions", "TuneResult", "TuneTask", "parse_size", "tune"]


class TuneTask(Protocol):
    """What a task tells the tune harness."""

    sample_rows: int  # the sample's size and the warm-up's, unless the options say
    warmup_rows: int
    recipe_kind: str  # what the sample holds, for the recipe's comment ("sampled rows")

    def objective(self, base: RunConfig, opts: TuneOptions) -> str:
        """The objective to optimise; refuses options the task cannot tune for."""

    def goal(self, goal: Goal) -> Goal: ...

    def search(self, base: RunConfig, opts: TuneOptions, goal: Goal, on_sample: OnSample, on_trial: OnTrial) -> tuple:
        """Draws the sample and runs the search: (sample, search, device kind)."""

    def columns(self) -> list[tuple[str, Callable[[Trial], Any]]]:
        """The CSV's figures of a trial, after its knobs."""

    def recipe(self, best: Trial, base: RunConfig, device: str) -> dict[str, Any]:
        """The `run` options a recipe sets: what was tuned, and what it was tuned under."""

    def recipe_notes(self, search: Search, base: RunConfig) -> list[str]: ...


def parse_size(text: str) -> int:
    """'800MB', '4GiB', '2g', '1048576' -> bytes (k/m/g/t are powers of 1024 either way)."""
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"--max-memory {text!r}: expected a size like 800MB or 4GiB")
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * 1024 ** "_kmgt".index(unit or "_"))


@dataclass(slots=True)
class TuneResult:
    sample: Any  # the task's sample (tune.sample.Sample, or generation's RequestSample)
    search: Search
    device: str
    goal: Goal

    @property
    def best(self) -> Trial:
        assert self.search.best is not None
        return self.search.best

    @property
    def default(self) -> Trial:
        assert self.search.default is not None
        return self.search.default


def tune(
    base: RunConfig,
    opts: TuneOptions,
    on_sample: Callable[[Any], None] | None = None,
    on_trial: Callable[[Search, Trial | None, str], None] | None = None,
) -> TuneResult:
    """Draws the sample, runs the search; `on_trial(search, trial, status)` drives a live display."""
    from ..registry import check_honoured, pick_task, settle_backend, task_named

    picked = task_named(pick_task(base))
    base, fallback = settle_backend(picked, base)  # NOTE: trials run the job directly: settled once, here
    if fallback:
        print(fallback, file=sys.stderr)
    check_honoured(picked, replace(base, task=picked.name))
    # NOTE: what the task settles (a score run's pair columns) is kept; the task as given stays, for the recipe
    base = replace(base, input=picked.settle(replace(base, task=picked.name)).input)
    task: TuneTask = picked.tuning()
    opts = replace(
        opts,
        sample_rows=task.sample_rows if opts.sample_rows is None else opts.sample_rows,
        warmup_rows=task.warmup_rows if opts.warmup_rows is None else opts.warmup_rows,
    )
    if opts.report_json or opts.report_html:
        from .report import check_report_paths

        check_report_paths(opts.report_json, opts.report_html)
    if opts.sample_rows < 1 or opts.repeats < 1:
        raise ConfigError("--sample and --repeats must be at least 1")
    objective = task.objective(base, opts)
    if objective == "latency" and base.input.rate is None:
        raise ConfigError("--objective latency needs --rate (per-request latency only exists under a rate)")
    memory = parse_size(opts.max_memory) if opts.max_memory else None
    goal = task.goal(Goal(objective, opts.max_p99_ms, memory, opts.min_gain))
    result = TuneResult(*task.search(base, opts, goal, on_sample, on_trial), goal)
    if opts.trials_csv:
        write_trials_csv(result, task.columns(), opts.trials_csv)
    if opts.recipe_path:
        write_recipe(result, task, base, opts.recipe_path)
    if opts.report_json or opts.report_html:
        from ..device.machine import machine_facts
        from .report import tune_report, write_tune_reports

        write_tune_reports(tune_report(result, base, machine_facts()), opts.report_json, opts.report_html)
    return result


def write_trials_csv(result: TuneResult, columns: list[tuple[str, Callable[[Trial], Any]]], path: str) -> None:
    knobs = list(result.best.params)
    fields = ["trial", *knobs, *(name for name, _ in columns)]
    fields += ["repeats", "gain_vs_default", "status", "note", "chosen"]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(fields)
        for t in result.search.trials:
            gain = "" if t.gain is None else round(t.gain, 4)
            figures = [figure(t) for _, figure in columns]
            chosen = t is result.best
            writer.writerow(
                [t.index, *(t.params[k] for k in knobs), *figures, t.repeats, gain, t.status, t.note, chosen]
            )


def write_recipe(result: TuneResult, task: TuneTask, base: RunConfig, path: str) -> None:
    best, default, goal = result.best, result.default, result.goal
    what = {"rows": "rows/s", "tokens": "tokens/s", "latency": "p99 request latency"}[goal.objective]
    if best is default:
        verdict = f"No setting beat the default by {goal.min_gain:.0%} or more, so these are the defaults."
    else:
        verdict = f"{shown_figure(best, goal)} against {shown_figure(default, goal)} for the default."
    lines = [
        f"Written by `hpcinfer tune` on {', '.join(base.input.paths)} ({result.sample.rows:,} {task.recipe_kind})",
        f"on {result.device}, optimising {what}. {verdict}",
        *task.recipe_notes(result.search, base),
        f"Use it for this model on this kind of input and hardware: hpcinfer run --config {Path(path).name} ...",
    ]
    values = task.recipe(best, base, result.device)
    Path(path).write_text(dump_recipe(values, "\n".join(lines)), encoding="utf-8")


def shown_figure(t: Trial, goal: Goal) -> str:
    if goal.objective == "latency":
        return f"p99 {t.p99_ms:,.1f} ms"
    if goal.objective == "tokens":
        return f"{t.tokens_per_s:,.1f} tokens/s"
    return f"{t.rows_per_s:,.2f} rows/s"
