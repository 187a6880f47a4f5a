"""`hpcinfer tune` for embedding: what the tune harness (tune/command.py) needs of this task.

The sample is N rows of the input stratified over token length; each trial runs the real stage
pipeline on it (tune/trial.py). The search walks the token budget coarse-to-fine, then the row
cap, then (on CUDA) streams and staging buffers, and under --rate the batch timeout.

The sample (`draw_sample`) is drawn from the input's first rows by token length
(tune.sample.stratified_indices) and written to a Parquet file the trials read; a trial
(`EmbedTrialRunner`) runs the embedding job on it, quiet, with one model loaded for every trial.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..config import InputConfig, PlanConfig, RunConfig, resolve_plan
from ..device import accelerators, dtype_for, make_device, resolve_dtype
from ..errors import InputError
from ..files.part_format import id_array
from ..files.scratch import ScratchDir
from ..models.registry import LoadedModel, load_model, load_tokenizer
from ..obs.progress import Progress
from ..tune.options import TuneOptions
from ..tune.sample import Sample, stratified_indices
from ..tune.search import Goal, OnSample, OnTrial, Search, Space, Trial, brief
from ..tune.trial import TrialRunner
from . import tune_view
from .given import RunExtras
from .job import run_embed
from .options import embed_checkpoint
from .plan import round_up
from .quantize import Int8Check, int8_model
from .read import Reader
from .report import RunReport


class EmbedTuning:
    """Embedding's `TuneTask`."""

    sample_rows, warmup_rows = 2000, 200
    recipe_kind = "sampled rows"

    def objective(self, base: RunConfig, opts: TuneOptions) -> str:
        return opts.objective or ("latency" if base.input.rate is not None else "rows")

    def goal(self, goal: Goal) -> Goal:
        return goal

    def search(self, base: RunConfig, opts: TuneOptions, goal: Goal, on_sample: OnSample, on_trial: OnTrial) -> tuple:
        assert opts.sample_rows is not None and opts.warmup_rows is not None  # resolved by the harness
        kind = device_kind(base.device.devices.split(",")[0].strip() if base.device.devices else base.device.device)
        info = embed_checkpoint(base)
        max_length = base.tokenize.max_length or info.max_seq_length
        with ScratchDir("tune") as tmp:
            workdir = Path(tmp)
            sample = draw_sample(base, opts.sample_rows, opts.sample_seed, workdir / "sample.parquet", opts.scan_rows)
            if on_sample is not None:
                on_sample(sample)
            rate, rate_seed = base.input.rate, base.input.rate_seed
            sample_input = InputConfig(
                (str(sample.path),),
                text_column="text",
                id_column="id",
                input_format="parquet",
                pair_columns=base.input.pair_columns,  # --task score: the sample keeps the pairs' columns
                rate=rate,
                rate_seed=rate_seed,
            )
            trial_base = replace(base, input=sample_input, report_path=None, report_html="off", trace_path=None)
            trial_base, model = self.choose_weights(trial_base, kind, max_length)
            search: Search

            def best_score() -> float:
                return goal.score(search.best) if search.best is not None else 0.0

            def repeat_started(params: dict[str, Any], i: int) -> None:
                if on_trial is not None:
                    on_trial(search, None, f"running {brief(params)} (repeat {i + 1}/{opts.repeats})")

            warmup = min(opts.warmup_rows, sample.rows)
            runner = EmbedTrialRunner(
                trial_base,
                workdir,
                opts.repeats,
                warmup,
                best_so_far=best_score,
                score=goal.score,
                on_repeat=repeat_started,
            )
            runner.preload(model)
            space = search_space(trial_base, kind, max_length, int(sample.lengths.min()))
            shown = None if on_trial is None else (lambda trial: on_trial(search, trial, ""))
            search = Search(runner, goal, space, on_trial=shown)
            search.view = tune_view
            search.run(default_params(trial_base, kind))
        return sample, search, kind

    int8_check: Int8Check | None = None

    def choose_weights(self, base: RunConfig, kind: str, max_length: int) -> tuple[RunConfig, LoadedModel | None]:
        """Under --quantize int8|auto on the CPU: int8 against float32 on the sample, once (quantize.py);
        the trials then run the model it chose, and the recipe says which."""
        if base.device.quantize not in ("int8", "auto") or kind != "cpu":
            return base, None
        info = embed_checkpoint(base)
        dtype = dtype_for(base.device.dtype, torch.device("cpu"))
        untimed = replace(base, input=replace(base.input, rate=None))
        model, self.int8_check = int8_model(untimed, info, torch.device("cpu"), dtype, max_length)
        chosen = "int8" if self.int8_check.chosen == "int8" else "none"
        return replace(base, device=replace(base.device, quantize=chosen)), model

    def columns(self) -> list[tuple[str, Callable[[Trial], Any]]]:
        return [
            ("rows_per_s", lambda t: round(t.rows_per_s, 3)),
            ("tokens_per_s", lambda t: round(t.tokens_per_s, 1)),
            ("p99_ms", lambda t: round(t.p99_ms, 3)),
            ("memory_mib", lambda t: round(t.memory_bytes / 2**20, 1)),
            ("saturated", lambda t: t.saturated),
        ]

    def recipe(self, best: Trial, base: RunConfig, device: str) -> dict[str, Any]:
        values: dict[str, Any] = {}
        if base.model != "default":
            values["model"] = base.model
        values["device"] = device
        if base.device.devices:  # one budget, tuned once, for every device
            values["devices"] = base.device.devices
        values["dtype"] = base.device.dtype
        if self.int8_check is not None:
            values["quantize"] = "int8" if self.int8_check.chosen == "int8" else "none"
        if base.tokenize.max_length is not None:
            values["max_length"] = base.tokenize.max_length
        values["tokenize_threads"] = base.tokenize.threads
        if base.device.threads is not None:
            values["threads"] = base.device.threads
        values.update(best.params)
        return values

    def recipe_notes(self, search: Search, base: RunConfig) -> list[str]:
        return [] if self.int8_check is None else [self.int8_check.line()]


def device_kind(spec: str) -> str:
    if spec in ("auto", "all"):
        return accelerators.default_kind()
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


class EmbedTrialRunner(TrialRunner):
    """The harness's runner with the embedding job, quiet, on one model loaded for every trial."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, run_job=self._run_quietly, **kwargs)

    def _run_quietly(self, config: RunConfig) -> RunReport:
        return run_embed(config, RunExtras(Progress("off"), model=self._model(config)))

    def _model(self, config: RunConfig) -> LoadedModel:
        """Loaded once for all trials: loading it per run would cost time and, held by the
        allocator afterwards, inflate the memory later trials are charged with."""
        if self._loaded is None:  # NOTE: with --devices, for the first one (the others load their own)
            first = config.device.devices.split(",")[0].strip() if config.device.devices else config.device.device
            device = make_device("cuda:0" if first == "all" else first, 1)
            try:
                dtype = resolve_dtype(config.device.dtype, device)
                self._loaded = load_model(embed_checkpoint(config), device.torch_device, dtype)
            finally:
                device.close()
        return self._loaded


def draw_sample(config: RunConfig, n: int, seed: int, out_path: Path, scan_rows: int) -> Sample:
    info = embed_checkpoint(config)
    max_length = config.tokenize.max_length or info.max_seq_length
    tokenizer = load_tokenizer(info.path, max_length)
    reader = Reader(replace(config.input, limit=scan_rows, rate=None), window_rows=max(scan_rows, 1))
    ids: list[Any] = []
    texts: list[str] = []
    tokens: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for block in reader.produce():
        ids.extend(block.ids)
        if block.texts is not None:
            texts.extend(block.texts)
            inputs = [tuple(t) if isinstance(t, list) else t for t in block.texts]  # text pairs (--task score)
            encoded = tokenizer.encode_batch(inputs, add_special_tokens=True)
            lengths.append(np.fromiter((len(e.ids) for e in encoded), np.int64, len(encoded)))
        elif block.token_ids is not None:
            flat, lens = block.token_ids
            tokens.extend(np.split(flat, np.cumsum(lens)[:-1]) if len(lens) else [])
            lengths.append(np.minimum(lens, max_length).astype(np.int64))
    if not ids:
        raise InputError("no valid rows to sample", path=", ".join(config.input.paths))
    all_lengths = np.concatenate(lengths)
    keep = stratified_indices(all_lengths, n, seed)
    columns: dict[str, pa.Array] = {"id": id_array([ids[i] for i in keep])}
    if texts and config.input.pair_columns:  # the sample keeps the pairs in the run's two columns
        for side, name in enumerate(config.input.pair_columns):
            columns[name] = pa.array([texts[i][side] for i in keep], pa.string())
    elif texts:
        columns["text"] = pa.array([texts[i] for i in keep], pa.string())
    else:
        columns["input_ids"] = pa.array([tokens[i].tolist() for i in keep], pa.list_(pa.int64()))
    pq.write_table(pa.table(columns), out_path)
    return Sample(out_path, len(keep), len(ids), all_lengths[keep], all_lengths)
