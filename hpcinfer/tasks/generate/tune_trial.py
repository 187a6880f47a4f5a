"""Generation trials: the user's requests through a fresh `Engine` on the decoder loaded once.

    sample = draw_requests(reader, n, seed, scan_rows)   # Requests, stratified over token work
    trial = GenerationTrialRunner(...)(params)           # warm-up, then --repeats measured passes

A pass admits the sample as `hpcinfer run` does (`Admission`: windows of --window-rows rows in
prefix order, the engine's queue kept short) and steps the engine until every sequence has
finished. Each pass gets an engine of its own, so the prefix cache never serves one repeat from
the blocks the previous repeat left behind.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ...device import accelerators
from ...device.base import is_out_of_memory
from ...engine.engine import Engine, EngineConfig
from ...engine.runtime.admission import Admission
from ...engine.runtime.loop import EngineSink, run_loop
from ...engine.sequence import Sequence
from ...errors import InputError
from ...job.windows import WindowBook
from ...models.llama import LlamaDecoder
from ...tune.sample import stratified_indices
from ...tune.search import Trial
from ...tune.trial import CLEARLY_WORSE, PeakRss, release_memory
from .report import percentiles
from .requests import Request, RequestReader
from .tally import SequenceTally

WARMUP_MAX_TOKENS = 16  # a warm-up pass runs prefill and a few decode widths, not whole answers
PROGRESS_EVERY_S = 1.0


@dataclass(slots=True)
class RequestSample:
    """Sampled requests, renumbered 0..n-1 in input order so windows hold --window-rows of them."""

    requests: list[Request]
    scanned: int
    rejected: int  # scanned rows that `run` would reject: not in the sample
    kv_tokens: int  # the KV pool's capacity, in tokens

    @property
    def rows(self) -> int:
        return len(self.requests)

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.array([len(r.tokens) for r in self.requests], np.int64)

    @property
    def max_tokens(self) -> np.ndarray:
        return np.array([r.params.max_tokens for r in self.requests], np.int64)

    @property
    def fit_rows(self) -> int:
        """About how many of these rows the KV pool holds at once, each at its longest."""
        return max(1, int(self.kv_tokens // max(float(np.mean(self.prompt_lengths + self.max_tokens)), 1.0)))

    def describe(self) -> str:
        def pct(a: np.ndarray) -> str:
            return "/".join(str(int(v)) for v in np.percentile(a, [10, 50, 90]))

        rejected = f", {self.rejected:,} rejected rows left out" if self.rejected else ""
        return (
            f"{self.rows:,} of {self.scanned:,} requests, stratified over prompt + max_tokens{rejected} "
            f"(prompt p10/p50/p90: {pct(self.prompt_lengths)} tokens; max_tokens: {pct(self.max_tokens)}); "
            f"the KV pool holds {self.kv_tokens:,} tokens, about {self.fit_rows:,} of these rows at once"
        )


def draw_requests(reader: RequestReader, n: int, seed: int, scan_rows: int, kv_tokens: int) -> RequestSample:
    """Reads up to `scan_rows` rows as generation requests; keeps n, stratified over token work."""
    requests: list[Request] = []
    rejected = 0
    for item in reader.produce():
        if isinstance(item, Request):
            requests.append(item)
        else:
            rejected += 1
        if len(requests) + rejected >= scan_rows:
            break
    if not requests:
        raise InputError("no valid requests to sample", path=", ".join(reader.files))
    work = np.array([len(r.tokens) + r.params.max_tokens for r in requests], np.int64)
    keep = stratified_indices(work, n, seed)
    sample = [replace(requests[int(i)], row=j) for j, i in enumerate(keep)]
    return RequestSample(sample, len(requests) + rejected, rejected, kv_tokens)


@dataclass(slots=True)
class Pass:
    """One run of the sample through an engine: what finished (`tally`), its wall time and peak memory."""

    tally: SequenceTally = field(default_factory=SequenceTally)
    wall_s: float = 0.0
    peak_bytes: int = 0

    def score(self, objective: str) -> float:
        done = self.rows if objective == "rows" else self.completion_tokens
        return done / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rows(self) -> int:
        return self.tally.rows

    @property
    def completion_tokens(self) -> int:
        return self.tally.completion_tokens

    @property
    def prompt_tokens(self) -> int:
        return self.tally.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.tally.cached_tokens


class GenerationTrialRunner:
    """Measures one parameter set: {max_num_batched_tokens, max_num_seqs, prefix_cache}."""

    def __init__(
        self,
        model: LlamaDecoder,
        base: EngineConfig,
        sample: RequestSample,
        eos_token_ids: Iterable[int],
        decode: Callable[[list[int]], str],
        *,
        repeats: int,
        warmup_rows: int,
        window_rows: int,
        prefix_order: bool,
        objective: str = "tokens",
        best_so_far: Callable[[], float] | None = None,
        on_status: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        self.model = model
        self.base = base
        self.sample = sample
        self.eos = tuple(eos_token_ids)
        self.decode = decode
        self.repeats = repeats
        self.warmup = [
            replace(r, params=replace(r.params, max_tokens=min(r.params.max_tokens, WARMUP_MAX_TOKENS)))
            for r in sample.requests[:warmup_rows]
        ]
        self.window_rows = window_rows
        self.prefix_order = prefix_order
        self.objective = objective
        self.best_so_far = best_so_far
        self.on_status = on_status

    def engine_config(self, params: dict[str, Any]) -> EngineConfig:
        return replace(
            self.base,
            max_num_batched_tokens=params["max_num_batched_tokens"],
            max_num_seqs=params["max_num_seqs"],
            prefix_cache=params["prefix_cache"],
        )

    def __call__(self, params: dict[str, Any]) -> Trial:
        config = self.engine_config(params)
        trial = Trial(dict(params))
        passes: list[Pass] = []
        try:
            if self.warmup:
                self._status(params, f"warm-up, {len(self.warmup)} rows")
                self.run_pass(config, self.warmup)
            for i in range(self.repeats):
                what = f"repeat {i + 1}/{self.repeats}"
                self._status(params, what)
                passes.append(
                    self.run_pass(config, self.sample.requests, lambda done, w=what: self._rows(params, w, done))
                )
                if i == 0 and self._clearly_worse(passes[0]):
                    trial.note = "1 repeat: slower"  # NOTE: short, the generation table is wide
                    break
        except (MemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            trial.status, trial.note = "infeasible", f"out of memory ({type(exc).__name__})"
        trial.repeats = len(passes)
        if passes:
            summarise(trial, passes, self.objective)
        return trial

    def _status(self, params: dict[str, Any], text: str) -> None:
        if self.on_status is not None:
            self.on_status(params, text)

    def _rows(self, params: dict[str, Any], what: str, done: int) -> None:
        self._status(params, f"{what}, {done:,}/{self.sample.rows:,} rows")

    def _clearly_worse(self, first: Pass) -> bool:
        if self.best_so_far is None or self.repeats < 2:
            return False
        best = self.best_so_far()
        return best > 0 and first.score(self.objective) < best * CLEARLY_WORSE

    def run_pass(
        self, config: EngineConfig, requests: list[Request], on_rows: Callable[[int], None] | None = None
    ) -> Pass:
        """The requests through a fresh engine, admitted as `run` admits them; the engine goes at the end."""
        release_memory()
        device = self.model.norm.device
        accelerators.release_cached(device)
        accelerators.start_peak(device)
        result = Pass()
        engine: Engine | None = None
        try:
            with PeakRss() as rss, torch.inference_mode():
                engine = Engine(self.model, config, self.eos, decode=self.decode)
                self._drive(engine, requests, result, on_rows)
            result.peak_bytes = accelerators.peak_bytes(device) if device.type == "cuda" else rss.peak
        finally:
            del engine  # NOTE: before the next engine is sized, its pool must be free again
            gc.collect()
            accelerators.release_cached(device)
        return result

    def _drive(self, engine: Engine, requests: list[Request], out: Pass, on_rows: Callable[[int], None] | None) -> None:
        book = WindowBook(self.window_rows, keep_results=False)  # NOTE: a pass keeps no results
        # NOTE: no rate and no rejects: the sample holds valid requests only, run as a batch job.
        admission = Admission(book, engine.config.max_num_seqs, self.prefix_order, None, 0)
        shown = [time.perf_counter()]

        def finished(seq: Sequence, _device: int) -> None:
            window, request = seq.tag
            book.finish(window, request.row, None)
            out.tally.add(seq)

        def show() -> None:
            for _ in book.complete():  # NOTE: nothing to commit: finished windows are only dropped
                pass
            if on_rows is not None and time.perf_counter() - shown[0] >= PROGRESS_EVERY_S:
                on_rows(out.rows)
                shown[0] = time.perf_counter()

        start = time.perf_counter()
        run_loop(admission, iter(requests), EngineSink(engine), finished, after=show)
        out.wall_s = time.perf_counter() - start


def summarise(trial: Trial, passes: list[Pass], objective: str) -> None:
    """Medians over the passes, and the slowest and fastest pass: the noise the repeats showed."""
    trial.rows_per_s = statistics.median(p.score("rows") for p in passes)
    trial.tokens_per_s = statistics.median(p.score("tokens") for p in passes)
    trial.ttft_ms = statistics.median(percentiles(p.tally.ttft).get("p50_ms", 0.0) for p in passes)
    trial.tpot_ms = statistics.median(percentiles(p.tally.tpot).get("p50_ms", 0.0) for p in passes)
    scores = [p.score(objective) for p in passes]
    middle = statistics.median(scores)
    trial.low, trial.high = min(scores), max(scores)
    trial.spread = (trial.high - trial.low) / middle if middle > 0 else 0.0
    prompt = sum(p.prompt_tokens for p in passes)
    trial.cached_share = sum(p.cached_tokens for p in passes) / prompt if prompt else 0.0
    trial.memory_bytes = max(p.peak_bytes for p in passes)
