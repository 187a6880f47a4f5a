"""`hpcinfer tune`: sample the input, search the knobs, show every trial, write the winner down."""

from __future__ import annotations

import csv
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import InputConfig, PlanConfig, RunConfig, resolve_plan
from ..errors import ConfigError
from ..models.checkpoint import inspect_checkpoint
from ..models.registry import resolve_model_path
from ..recipes import dump_recipe
from ..tasks.embed.plan import round_up
from .gen_command import (
    SAMPLE_ROWS,
    WARMUP_ROWS,
    check_generation_options,
    tune_generate,
    write_generation_csv,
    write_generation_recipe,
)
from .gen_search import NoisyGoal
from .gen_trial import RequestSample
from .options import TuneOptions
from .sample import Sample, draw_sample
from .search import Goal, Search, Space, Trial
from .trial import TrialRunner

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


__all__ = ["TuneOptions", "TuneResult", "parse_size", "tune"]


def parse_size(text: str) -> int:
    """'800MB', '4GiB', '2g', '1048576' -> bytes (k/m/g/t are powers of 1024 either way)."""
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"--max-memory {text!r}: expected a size like 800MB or 4GiB")
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * 1024 ** "_kmgt".index(unit or "_"))


@dataclass(slots=True)
class TuneResult:
    sample: Sample | RequestSample
    search: Search  # a GenerationSearch for a causal LM
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


def device_kind(spec: str) -> str:
    if spec in ("auto", "all"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if spec.startswith("cuda") else spec


def search_space(base: RunConfig, kind: str, max_length: int, shortest_row: int) -> Space:
    space = Space(
        token_min=max(256, round_up(max_length, base.plan.pad_multiple)),
        token_max=262_144 if kind == "cuda" else 65_536,
        min_row_tokens=round_up(max(shortest_row, 1), base.plan.pad_multiple),
    )
    if kind == "cpu":
        space.skipped.append("streams, staging buffers: the CPU device is synchronous, they change nothing")
    else:
        space.streams, space.staging_buffers = (1, 2, 4), (2, 3, 4)
    if base.input.rate is not None:
        space.timeouts_ms = (2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    else:
        space.skipped.append("batch timeout: only matters with --rate")
    return space


def default_params(base: RunConfig, kind: str) -> dict[str, Any]:
    plan = resolve_plan(replace(base.plan, max_batch_tokens=None, batch_timeout_ms=None), kind, base.input.rate)
    params: dict[str, Any] = {
        "max_batch_tokens": plan.max_batch_tokens,
        "max_batch_size": PlanConfig().max_batch_size,
        "streams": 1,
        "staging_buffers": 2,
    }
    if base.input.rate is not None:
        params["batch_timeout_ms"] = plan.batch_timeout_ms
    return params


def tune(
    base: RunConfig,
    opts: TuneOptions,
    on_sample: Callable[[Sample], None] | None = None,
    on_trial: Callable[[Search, Trial | None, str], None] | None = None,
) -> TuneResult:
    """Draws the sample, runs the search; `on_trial(search, trial, status)` drives a live display."""
    from ..tasks import pick_task

    generating = pick_task(base) == "generate"
    opts = replace(
        opts,
        sample_rows=(SAMPLE_ROWS if generating else 2000) if opts.sample_rows is None else opts.sample_rows,
        warmup_rows=(WARMUP_ROWS if generating else 200) if opts.warmup_rows is None else opts.warmup_rows,
    )
    if opts.sample_rows < 1 or opts.repeats < 1:
        raise ConfigError("--sample and --repeats must be at least 1")
    if generating:
        objective = check_generation_options(base, opts.objective, opts.max_p99_ms)
    else:
        objective = opts.objective or ("latency" if base.input.rate is not None else "rows")
    if objective == "latency" and base.input.rate is None:
        raise ConfigError("--objective latency needs --rate (per-request latency only exists under a rate)")
    goal = Goal(
        objective,
        opts.max_p99_ms,
        parse_size(opts.max_memory) if opts.max_memory else None,
        opts.min_gain,
    )
    if generating:
        return _tune_generate(base, opts, goal, on_sample, on_trial)
    kind = device_kind(base.device.devices.split(",")[0].strip() if base.device.devices else base.device.device)
    info = inspect_checkpoint(resolve_model_path(base.model))
    max_length = base.tokenize.max_length or info.max_seq_length
    with tempfile.TemporaryDirectory(prefix="hpcinfer-tune-") as tmp:
        workdir = Path(tmp)
        sample = draw_sample(base, opts.sample_rows, opts.sample_seed, workdir / "sample.parquet", opts.scan_rows)
        if on_sample is not None:
            on_sample(sample)
        trial_base = replace(
            base,
            input=InputConfig(
                (str(sample.path),), "text", "id", "parquet", rate=base.input.rate, rate_seed=base.input.rate_seed
            ),
            report_path=None,
            trace_path=None,
        )
        search: Search

        def best_score() -> float:
            return goal.score(search.best) if search.best is not None else 0.0

        def repeat_started(params: dict[str, Any], i: int) -> None:
            if on_trial is not None:
                on_trial(search, None, f"running {_brief(params)} (repeat {i + 1}/{opts.repeats})")

        runner = TrialRunner(
            trial_base,
            workdir,
            opts.repeats,
            min(opts.warmup_rows, sample.rows),
            best_so_far=best_score,
            score=goal.score,
            on_repeat=repeat_started,
        )
        search = Search(
            runner,
            goal,
            search_space(trial_base, kind, max_length, int(sample.lengths.min())),
            on_trial=None if on_trial is None else (lambda trial: on_trial(search, trial, "")),
        )
        search.run(default_params(trial_base, kind))
    result = TuneResult(sample, search, kind, goal)
    if opts.trials_csv:
        write_trials_csv(result, opts.trials_csv)
    if opts.recipe_path:
        write_recipe(result, base, opts.recipe_path)
    return result


def _tune_generate(
    base: RunConfig,
    opts: TuneOptions,
    goal: Goal,
    on_sample: Callable[[Any], None] | None,
    on_trial: Callable[[Search, Trial | None, str], None] | None,
) -> TuneResult:
    goal = NoisyGoal(goal.objective, goal.max_p99_ms, goal.max_memory_bytes, goal.min_gain)
    sample, search, kind = tune_generate(base, opts, goal, on_sample, on_trial)
    result = TuneResult(sample, search, kind, goal)
    if opts.trials_csv:
        write_generation_csv(search, result.best, opts.trials_csv)
    if opts.recipe_path:
        write_generation_recipe(search, base, sample, kind, opts.recipe_path)
    return result


def _brief(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k.replace('_', '-')}={v:g}" if isinstance(v, float) else f"{k.replace('_', '-')}={v}"
        for k, v in params.items()
    )


def write_trials_csv(result: TuneResult, path: str) -> None:
    fields = [
        "trial",
        *result.best.params,
        "rows_per_s",
        "tokens_per_s",
        "p99_ms",
        "memory_mib",
        "saturated",
        "repeats",
        "gain_vs_default",
        "status",
        "note",
        "chosen",
    ]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(fields)
        for t in result.search.trials:
            writer.writerow(
                [
                    t.index,
                    *(t.params[k] for k in result.best.params),
                    round(t.rows_per_s, 3),
                    round(t.tokens_per_s, 1),
                    round(t.p99_ms, 3),
                    round(t.memory_bytes / 2**20, 1),
                    t.saturated,
                    t.repeats,
                    "" if t.gain is None else round(t.gain, 4),
                    t.status,
                    t.note,
                    t is result.best,
                ]
            )


def recipe_values(result: TuneResult, base: RunConfig) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if base.model != "default":
        values["model"] = base.model
    values["device"] = result.device
    if base.device.devices:  # one budget, tuned once, for every device
        values["devices"] = base.device.devices
    values["dtype"] = base.device.dtype
    if base.tokenize.max_length is not None:
        values["max_length"] = base.tokenize.max_length
    values["tokenize_threads"] = base.tokenize.threads
    if base.device.threads is not None:
        values["threads"] = base.device.threads
    values.update(result.best.params)
    return values


def write_recipe(result: TuneResult, base: RunConfig, path: str) -> None:
    best, default = result.best, result.default
    what = {"rows": "rows/s", "tokens": "tokens/s", "latency": "p99 request latency"}[result.goal.objective]
    if best is default:
        verdict = f"No setting beat the default by {result.goal.min_gain:.0%} or more, so these are the defaults."
    else:
        verdict = f"{_figure(best, result.goal)} against {_figure(default, result.goal)} for the default."
    comment = (
        f"Written by `hpcinfer tune` on {', '.join(base.input.paths)} ({result.sample.rows:,} sampled rows)\n"
        f"on {result.device}, optimising {what}. {verdict}\n"
        f"Use it for this model on this kind of data and hardware: hpcinfer run --config {Path(path).name} ..."
    )
    Path(path).write_text(dump_recipe(recipe_values(result, base), comment), encoding="utf-8")


def _figure(t: Trial, goal: Goal) -> str:
    if goal.objective == "latency":
        return f"p99 {t.p99_ms:,.1f} ms"
    if goal.objective == "tokens":
        return f"{t.tokens_per_s:,.0f} tokens/s"
    return f"{t.rows_per_s:,.1f} rows/s"
