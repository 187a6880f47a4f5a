"""The library entry point: `run(RunConfig) -> RunReport`. The CLI is a thin shell over this."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from .arrivals import ArrivalReplay
from .config import RunConfig, flatten, resolve_plan
from .device import Device, OutputPool, StagingRing, make_device, resolve_dtype
from .errors import ConfigError, HpcinferError
from .execute import Executor
from .models.checkpoint import CheckpointInfo, inspect_checkpoint
from .models.registry import LoadedModel, load_model, load_tokenizer, resolve_model_path
from .output import PartStore, fingerprint
from .pipeline import run_overlapped, run_serial
from .plan import Planner, TokenBudget, round_up
from .profile import RangeBackend
from .progress import Progress
from .read import Reader, estimate_rows, id_key
from .report.latency import LatencyLog
from .report.summary import RunReport
from .report.timing import Timings, bottleneck
from .report.trace import write_trace
from .stage import StageStep
from .tokenize import TokenizeStage
from .types import Pending
from .write import RejectCounter, Writer, check_output, output_format


class Interrupted(HpcinferError):
    """SIGINT/SIGTERM: committed windows are kept; the run can be resumed."""

    def __init__(self, signum: int, rows_done: int, output: str) -> None:
        self.signum = signum
        self.rows_done = rows_done
        self.exit_code = 128 + signum
        super().__init__(f"interrupted: {rows_done:,} rows are committed", path=output)


def run(
    config: RunConfig,
    *,
    device: Device | None = None,
    progress: Progress | None = None,
    hooks: dict[str, Callable[[Any], None]] | None = None,
    ranges: RangeBackend | None = None,
    batch_profiler: Any = None,
    model: LoadedModel | None = None,
) -> RunReport:
    """Embeds every valid input row and writes one output row per valid row, in input order.

    Rejected rows go to OUTPUT.rejects.jsonl. `device` overrides `config.device.device` (tests pass
    a simulated or fault-injecting device); `hooks` maps a stage name to a callable run before each
    item of that stage (fault injection in tests). `model`, already loaded for this device and
    dtype, saves loading it again (tune's trials share one).
    """
    config.validate()
    if config.task != "embed":
        from .generate.job import run_generate, wants_generation

        if wants_generation(config):
            return run_generate(config, progress=progress)  # type: ignore[return-value]
    own_device = device is None
    device = device or make_device(config.device.device, config.device.streams)
    config = replace(config, plan=resolve_plan(config.plan, device.kind, config.input.rate))
    try:
        return _run(config, device, progress, hooks, ranges, batch_profiler, model)
    finally:
        if own_device:
            device.close()


def _run(
    config: RunConfig,
    device: Device,
    progress: Progress | None,
    hooks: Any,
    ranges: Any,
    batch_profiler: Any,
    preloaded: LoadedModel | None,
) -> RunReport:
    fmt = output_format(config.output.path, config.output.output_format)
    check_output(config.output.path, config.output.overwrite, config.output.resume)
    info = inspect_checkpoint(resolve_model_path(config.model))
    max_length = _check_lengths(config, info)
    reader = Reader(config.input, config.plan.sort_window)  # input problems surface here, before any work

    dtype = resolve_dtype(config.device.dtype, device)
    store = PartStore(
        config.output.path, fmt, info.config.hidden_size, _fingerprint(config, info, reader, max_length, dtype)
    )
    first_window = _open_store(store, reader, config.output.resume)
    report = RunReport(device=device.kind, dtype=str(dtype).removeprefix("torch."), model=str(info.path))
    stop = threading.Event()
    timings = Timings(keep_spans=config.trace_path is not None)
    progress = progress or Progress(config.pipeline.progress)
    progress.set_total(max((estimate_rows(reader.sources) or 0) - reader.skip_rows, 0))
    if config.device.threads:
        torch.set_num_threads(config.device.threads)
    rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
    try:
        model = preloaded or load_model(info, device.torch_device, dtype)
        plan = config.plan
        budget = TokenBudget(plan.max_batch_tokens, round_up(max_length, plan.pad_multiple))
        ring = StagingRing(device, config.device.staging_buffers, plan.max_batch_tokens, plan.max_batch_size, stop)
        outputs = OutputPool(
            device,
            config.device.staging_buffers + config.device.streams,
            plan.max_batch_size,
            model.embedder.output_dim,
            stop,
        )

        def on_batch(pending: Pending) -> None:
            batch = pending.batch
            if pending.out is not None:
                _record_device_spans(timings, pending)
                report.batches += 1
                report.oom_splits += pending.splits[0]
            report.real_tokens += batch.real_tokens
            report.padded_tokens += batch.padded_tokens
            progress.advance(batch.num_rows, batch.real_tokens)

        latency = LatencyLog()
        writer = Writer(store, outputs, rejects, first_window, on_batch, latency)
        tokenize = _CountingTokenizer(
            load_tokenizer(info.path, max_length), max_length, info.config.vocab_size, config.tokenize.on_long, report
        )
        rate = config.input.rate
        planner = Planner(
            plan, budget, first_window, rejects.add, online=rate is not None, timeout_ms=plan.batch_timeout_ms
        )
        source = reader if rate is None else ArrivalReplay(reader.produce, rate, config.input.rate_seed, stop=stop)
        executor = Executor(
            device, model.embedder, ring, outputs, _graphs(config, device, model, plan), budget, batch_profiler
        )
        stages = [tokenize, planner, StageStep(device, ring), executor, writer]
        start = time.perf_counter()
        with _signals_stop(stop) as interrupted:
            if config.pipeline.overlap:
                run_overlapped(
                    source,
                    stages,
                    timings,
                    queue_depth=config.pipeline.queue_depth,
                    workers={"tokenize": config.tokenize.threads},
                    stop=stop,
                    hooks=hooks,
                    ranges=ranges,
                )
            else:
                run_serial(source, stages, timings, stop=stop, hooks=hooks, ranges=ranges)
        if interrupted:
            raise Interrupted(interrupted[0], store.rows_written, config.output.path)
        store.assemble()
        report.wall_s = time.perf_counter() - start
    except BaseException:
        stop.set()
        if not store.windows:  # nothing worth resuming: leave no trace
            shutil.rmtree(store.dir, ignore_errors=True)
        raise
    finally:
        progress.close()

    report.rows = store.rows_written
    report.rows_resumed = store.rows_written - writer.rows_written
    report.windows = planner.windows
    report.rejects = dict(sorted(rejects.by_reason.items()))
    report.final_max_batch_tokens = budget.tokens
    report.output = config.output.path
    report.stages = timings.summary(report.wall_s)
    report.bottleneck, report.hint = bottleneck(report.stages, synchronous_device=device.kind == "cpu")
    report.peak_device_memory_bytes = device.peak_memory_bytes()
    report.batch_latency_ms = latency.batch_summary()
    report.arrivals = latency.request_summary(config.input.rate)
    report.config = flatten(config)
    if config.report_path:
        report.write_json(config.report_path)
    if config.trace_path:
        write_trace(timings.spans, config.trace_path)
    return report


def _check_lengths(config: RunConfig, info: CheckpointInfo) -> int:
    max_length = config.tokenize.max_length or info.max_seq_length
    if max_length > info.config.max_position_embeddings:
        raise ConfigError(
            f"--max-length {max_length} exceeds the model's {info.config.max_position_embeddings} positions"
        )
    if round_up(max_length, config.plan.pad_multiple) > config.plan.max_batch_tokens:
        raise ConfigError(
            f"--max-batch-tokens {config.plan.max_batch_tokens} cannot hold one row of {max_length} tokens"
        )
    return max_length


def _fingerprint(config: RunConfig, info: CheckpointInfo, reader: Reader, max_length: int, dtype: torch.dtype) -> dict:
    """Inputs and every option that changes which rows land in which part, or their values."""
    files = [s.path for s in reader.sources]
    return fingerprint(
        files,
        info.path,
        {
            "max_length": max_length,
            "pooling": info.pooling.mode,
            "normalize": info.pooling.normalize,
            "dtype": str(dtype),
            "sort_window": config.plan.sort_window,
            "on_long": config.tokenize.on_long,
            "text_column": config.input.text_column,
            "id_column": config.input.id_column,
        },
    )


def _open_store(store: PartStore, reader: Reader, resume: bool) -> int:
    """Starts a fresh parts directory, or picks up a previous run's: returns the first window to do."""
    if resume and store.dir.exists():
        store.load()
        reader.skip_rows = store.rows_committed
        reader.remember_ids(id_key(i) for i in store.committed_ids())
        return len(store.windows)
    store.start_fresh()
    return 0


def _graphs(config: RunConfig, device: Device, model: Any, plan: Any) -> Any:
    if not config.device.cuda_graphs:
        return None
    if device.kind != "cuda":
        raise ConfigError("--cuda-graphs needs a CUDA device")
    from .device.graphs import GraphRunner

    return GraphRunner(model.embedder.__call__, plan.max_batch_size, device.torch_device)


@contextmanager
def _signals_stop(stop: threading.Event) -> Iterator[list[int]]:
    """First SIGINT/SIGTERM stops the stages (committed windows stay); a second one exits at once."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum: int, _frame: Any) -> None:
        if got:
            import os

            os._exit(128 + signum)  # committed parts are valid: every one was renamed into place whole
        got.append(signum)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _CountingTokenizer(TokenizeStage):
    """The tokenize stage, also counting truncated rows into the report."""

    def __init__(self, tokenizer: Any, max_length: int, vocab: int, on_long: str, report: RunReport) -> None:
        super().__init__(tokenizer, max_length, vocab, on_long)
        self._report = report
        self._lock = threading.Lock()

    def process(self, block):  # noqa: ANN001, ANN201
        for out in super().process(block):
            with self._lock:
                self._report.truncated_rows += out.truncated
            yield out


def _record_device_spans(timings: Timings, pending: Pending) -> None:
    """Device work, timed by events on the stream that did it; all complete once d2h_done is."""
    ev = pending.out.events
    args = {"batch": pending.batch.batch_id, "rows": pending.batch.num_rows, "tokens": pending.batch.padded_tokens}
    compute_track = f"compute{pending.stream}"
    for stage, start, end, track in (
        ("h2d", "h2d_start", "h2d_done", "copy"),
        ("compute", "compute_start", "compute_done", compute_track),
        ("d2h", "compute_done", "d2h_done", compute_track),
    ):
        timings.busy(stage, ev[start].time_ns(), ev[end].time_ns(), track, **args)
