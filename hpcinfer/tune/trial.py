"""One tuning trial: the real pipeline on the sample, warmed up, repeated, summarised by medians."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import statistics
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..device import accelerators
from ..device.base import is_out_of_memory
from ..errors import StageError
from .search import Trial

# A first repeat under this share of the best so far settles the trial: with --min-gain 5% the
# remaining repeats are very unlikely to make it the pick, and they cost a minute each on a CPU.
CLEARLY_WORSE = 0.90


def apply_params(base: RunConfig, params: dict[str, Any]) -> RunConfig:
    plan = replace(
        base.plan,
        max_batch_tokens=params["max_batch_tokens"],
        max_batch_size=params["max_batch_size"],
        batch_timeout_ms=params.get("batch_timeout_ms", base.plan.batch_timeout_ms),
    )
    device = replace(base.device, streams=params["streams"], staging_buffers=params["staging_buffers"])
    return replace(base, plan=plan, device=device)


def release_memory() -> None:
    """Hands memory freed by the previous trial back to the OS, so this trial's peak RSS is
    mostly its own (glibc keeps freed memory otherwise); a no-op where there is no glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRss:
    """Samples this process's resident set every 20 ms while a trial runs (ru_maxrss never falls)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    @staticmethod
    def current() -> int:
        try:
            with open("/proc/self/statm", encoding="ascii") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):  # not Linux: no sampling
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            self._stop.wait(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


class TrialRunner:
    """Runs `run_job(config)` on the sample for each parameter set (a task's runner gives its job:
    pipeline/tuning.py)."""

    def __init__(
        self,
        base: RunConfig,
        workdir: Path,
        repeats: int,
        warmup_rows: int,
        run_job: Callable[[RunConfig], Any],
        best_so_far: Callable[[], float] | None = None,
        score: Callable[[Trial], float] | None = None,
        on_repeat: Callable[[dict[str, Any], int], None] | None = None,
    ) -> None:
        self.base = base
        self.workdir = workdir
        self.repeats = repeats
        self.warmup_rows = warmup_rows
        self._run = run_job
        self._loaded: Any = None  # the model every trial shares (a task runner loads it)
        self.best_so_far = best_so_far
        self.score = score
        self.on_repeat = on_repeat

    def preload(self, model: Any) -> None:
        """The model every trial runs (an int8 one chosen before the search), instead of loading it."""
        if model is not None:
            self._loaded = model

    def __call__(self, params: dict[str, Any]) -> Trial:
        config = apply_params(self.base, params)
        output = replace(config.output, path=str(self.workdir / "trial.parquet"), overwrite=True)
        config = replace(config, output=output)
        trial = Trial(dict(params))
        reports: list[Any] = []
        peaks: list[int] = []
        try:
            if self.warmup_rows:
                self._run(replace(config, input=replace(config.input, limit=self.warmup_rows)))
            for i in range(self.repeats):
                if self.on_repeat is not None:
                    self.on_repeat(params, i)
                release_memory()
                if config.device.device.startswith("cuda") and accelerators.cuda_available():
                    accelerators.start_peak(torch.device(config.device.device))
                with PeakRss() as rss:
                    report = self._run(config)
                reports.append(report)
                peaks.append(report.peak_device_memory_bytes or rss.peak)
                if report.oom_splits or report.rejects.get("oom"):
                    trial.status = "infeasible"
                    trial.note = f"out of memory: budget lowered to {report.final_max_batch_tokens:,} tokens"
                    break
                if i == 0 and self._clearly_worse(report):
                    trial.note = "one repeat: clearly slower than the best"
                    break
        except (MemoryError, RuntimeError, StageError) as exc:
            cause = exc.__cause__ if isinstance(exc, StageError) and exc.__cause__ is not None else exc
            if not is_out_of_memory(cause):
                raise
            trial.status, trial.note = "infeasible", f"out of memory ({type(cause).__name__})"
        trial.repeats = len(reports)
        if reports:
            _summarise(trial, reports, peaks)
        return trial

    def _clearly_worse(self, report: Any) -> bool:
        if self.best_so_far is None or self.score is None or self.repeats < 2:
            return False
        probe = Trial({})
        _summarise(probe, [report], [0])
        best = self.best_so_far()
        score = self.score(probe)
        if best <= 0 or score <= 0:  # latency scores are negative: no early stop there
            return False
        return score < best * CLEARLY_WORSE


def _summarise(trial: Trial, reports: list[Any], peaks: list[int]) -> None:
    trial.rows_per_s = statistics.median(r.rows_per_s for r in reports)
    trial.tokens_per_s = statistics.median(r.tokens_per_s for r in reports)
    if all(r.arrivals for r in reports):
        trial.p99_ms = statistics.median(r.arrivals["latency_ms"]["p99"] for r in reports)
        trial.saturated = sum(bool(r.arrivals["saturated"]) for r in reports) * 2 > len(reports)
    else:
        trial.p99_ms = statistics.median(r.batch_latency_ms.get("p99", 0.0) for r in reports)
    trial.memory_bytes = max(peaks)
