"""The embedding job: rows -> tokenize -> plan -> stage -> execute -> write, on one or several devices.

`run_embed` settles the run's devices, model facts, output and reader, claims the output, then runs
the stage pipeline (overlapped, or its serial twin) and fills the report. A Ray replica runs the
same `execute_job` over the window range it is handed (replica.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ...config import RunConfig, flatten, resolve_plan
from ...device import Device, resolve_dtype
from ...errors import ConfigError, Interrupted
from ...files.arrivals import ArrivalReplay
from ...files.parts import PartStore, fingerprint
from ...files.read import Reader
from ...files.sources import estimate_rows
from ...job.accounting import settle
from ...job.claim import claimed, open_store
from ...job.output_checks import check_output, output_format
from ...job.pipeline import Fanout, run_overlapped
from ...job.rejects import RejectCounter
from ...job.serial import run_serial
from ...job.signals import signals_stop
from ...models.checkpoint import CheckpointInfo, inspect_checkpoint
from ...models.registry import LoadedModel, load_tokenizer, resolve_model_path
from ...obs.latency import LatencyLog
from ...obs.profile import RangeBackend
from ...obs.progress import Progress
from ...obs.timing import Timings, bottleneck
from ...obs.trace import write_trace
from ...place.devices import device_labels, make_run_devices
from ...place.dispatch import Dispatcher
from ...types import Pending
from .plan import Planner, TokenBudget, max_padded_len
from .replicas import DeviceLog, ResultWait, build_replicas
from .report import RunReport
from .tokenize import TokenizeStage
from .write import Writer


def run_embed(
    config: RunConfig,
    *,
    device: Device | None = None,
    devices: list[Device] | None = None,
    progress: Progress | None = None,
    hooks: dict[str, Callable[[Any], None]] | None = None,
    ranges: RangeBackend | None = None,
    batch_profiler: Any = None,
    model: LoadedModel | None = None,
) -> RunReport:
    """Embeds every valid input row on this machine's devices; see `api.run` for the arguments."""
    config.validate()
    own_devices = device is None and devices is None
    if devices is None:
        devices = [device] if device is not None else make_run_devices(config)
    try:
        if len({d.kind for d in devices}) > 1:
            raise ConfigError(f"--devices: one kind of device per run (got {', '.join(d.kind for d in devices)})")
        config = replace(config, plan=resolve_plan(config.plan, devices[0].kind, config.input.rate))
        return run_embed_job(config, devices, progress, hooks, ranges, batch_profiler, model)
    finally:
        if own_devices:
            for d in devices:
                d.close()


def run_embed_job(
    config: RunConfig,
    devices: list[Device],
    progress: Progress | None,
    hooks: Any,
    ranges: Any,
    batch_profiler: Any,
    preloaded: LoadedModel | None,
) -> RunReport:
    fmt = output_format(config.output.path, config.output.output_format)
    check_output(config.output.path)
    info = inspect_checkpoint(resolve_model_path(config.model))
    max_length = check_lengths(config, info)
    reader = Reader(config.input, config.plan.sort_window)  # input problems surface here, before any work

    dtype = resolve_dtype(config.device.dtype, devices[0])
    store = PartStore(
        config.output.path, fmt, info.config.hidden_size, embed_fingerprint(config, info, reader, max_length, dtype)
    )
    with claimed(store, config.output.path):
        return execute_job(
            EmbedJob(config, devices, store, reader, info, max_length, dtype),
            progress,
            hooks,
            ranges,
            batch_profiler,
            preloaded,
        )


@dataclass(frozen=True, slots=True)
class EmbedJob:
    """What start-up settled: the run's config, device, output store, reader and model facts."""

    config: RunConfig
    devices: list[Device]  # one replica each
    store: PartStore
    reader: Reader
    info: CheckpointInfo
    max_length: int
    dtype: torch.dtype
    # None: from the output's state (fresh, or resumed after the committed windows). A cluster
    # replica runs one window range and gives its first window here (see replica.py).
    first_window: int | None = None


def execute_job(
    job: EmbedJob,
    progress: Progress | None,
    hooks: Any,
    ranges: Any,
    batch_profiler: Any,
    preloaded: LoadedModel | None,
) -> RunReport:
    config, devices, store, reader, info = job.config, job.devices, job.store, job.reader, job.info
    max_length = job.max_length
    first_window = open_store(store, reader, config.output) if job.first_window is None else job.first_window
    labels = device_labels([str(d.torch_device) if d.kind == "cuda" else d.kind for d in devices])
    shown = devices[0].kind if len(devices) == 1 else ", ".join(labels)
    report = RunReport(device=shown, dtype=str(job.dtype).removeprefix("torch."), model=str(info.path))
    stop = threading.Event()
    timings = Timings(keep_spans=config.trace_path is not None)
    progress = progress or Progress(config.pipeline.progress)
    progress.set_total(max((estimate_rows(reader.sources) or 0) - reader.skip_rows, 0))
    if len(devices) > 1:
        progress.set_devices(labels)
    if config.device.threads and len(devices) == 1:
        torch.set_num_threads(config.device.threads)
    rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
    device_log = DeviceLog(labels)
    dispatcher = Dispatcher(len(devices), config.device.dispatch)
    try:
        plan = config.plan
        max_width = max_padded_len(max_length, plan.pad_multiple, info.config.max_position_embeddings)
        budget = TokenBudget(plan.max_batch_tokens, max_width)
        replicas = build_replicas(
            config, devices, labels, info, job.dtype, budget, max_width, stop, batch_profiler, preloaded
        )

        def on_batch(pending: Pending) -> None:
            batch = pending.batch
            compute_ns = 0
            if pending.out is not None:
                _record_device_spans(timings, pending, labels[pending.replica] if len(labels) > 1 else "")
                ev = pending.out.events
                compute_ns = ev["compute_done"].time_ns() - ev["compute_start"].time_ns()
                device_log.batch_done(
                    pending.replica, batch.num_rows, batch.padded_tokens, compute_ns, ev["d2h_done"].time_ns()
                )
                report.batches += 1
                report.oom_splits += pending.splits[0]
            dispatcher.done(pending.replica, batch.padded_tokens, compute_ns / 1e9)
            report.real_tokens += batch.real_tokens
            report.padded_tokens += batch.padded_tokens
            progress.advance(batch.num_rows, batch.real_tokens, device=pending.replica)

        latency = LatencyLog()
        writer = Writer(store, [r.outputs for r in replicas], rejects, first_window, on_batch, latency)
        tokenize = _CountingTokenizer(
            load_tokenizer(info.path, max_length), max_length, info.config.vocab_size, config.tokenize.on_long, report
        )
        rate = config.input.rate
        planner = Planner(
            plan,
            budget,
            first_window,
            rejects.add,
            online=rate is not None,
            timeout_ms=plan.batch_timeout_ms,
            max_width=max_width,
        )
        source = reader if rate is None else ArrivalReplay(reader.produce, rate, config.input.rate_seed, stop=stop)
        if len(replicas) == 1:
            only = replicas[0]
            stages: list[Any] = [tokenize, planner, only.stage, only.executor, writer]
            thread_init = only.device.bind_thread
        else:
            fan = Fanout(
                "dispatch",
                lambda batch: dispatcher.choose(batch.padded_tokens, batch.num_rows),
                [[r.stage, r.executor, ResultWait()] for r in replicas],
                [r.device.bind_thread for r in replicas],
                labels,
            )
            stages, thread_init = [tokenize, planner, fan, writer], None
        start = time.perf_counter()
        start_ns = time.perf_counter_ns()
        with signals_stop(stop) as interrupted:
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
                    thread_init=thread_init,
                )
            else:
                run_serial(source, stages, timings, stop=stop, hooks=hooks, ranges=ranges, thread_init=thread_init)
        if interrupted:
            raise Interrupted(interrupted[0], store.rows_written, config.output.path)
        report.accounting = settle(
            ((c.path, c.read, c.resumed) for c in reader.counts.values()),
            writer.written_by_source,
            rejects.by_source,
        )
        end_ns = time.perf_counter_ns()
        store.assemble()
        report.wall_s = time.perf_counter() - start
    except BaseException:
        stop.set()
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
    report.bottleneck, report.hint = bottleneck(report.stages, synchronous_device=devices[0].kind == "cpu")
    peaks = [p for d in devices if (p := d.peak_memory_bytes()) is not None]
    report.peak_device_memory_bytes = sum(peaks) if peaks else None
    report.devices = device_log.summary(start_ns, end_ns)
    report.batch_latency_ms = latency.batch_summary()
    report.arrivals = latency.request_summary(config.input.rate)
    report.config = flatten(config)
    if config.report_path:
        report.write_json(config.report_path)
    if config.trace_path:
        write_trace(timings.spans, config.trace_path)
    return report


def check_lengths(config: RunConfig, info: CheckpointInfo) -> int:
    max_length = config.tokenize.max_length or info.max_seq_length
    if max_length > info.config.max_position_embeddings:
        raise ConfigError(
            f"--max-length {max_length} exceeds the model's {info.config.max_position_embeddings} positions"
        )
    width = max_padded_len(max_length, config.plan.pad_multiple, info.config.max_position_embeddings)
    if width > config.plan.max_batch_tokens:
        raise ConfigError(
            f"--max-batch-tokens {config.plan.max_batch_tokens} cannot hold one row of {max_length} tokens"
        )
    return max_length


def embed_fingerprint(
    config: RunConfig, info: CheckpointInfo, reader: Reader, max_length: int, dtype: torch.dtype
) -> dict:
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


def _record_device_spans(timings: Timings, pending: Pending, device: str = "") -> None:
    """Device work, timed by events on the stream that did it; all complete once d2h_done is.

    With several devices each stream is a track of its own, named after its device.
    """
    ev = pending.out.events
    args = {"batch": pending.batch.batch_id, "rows": pending.batch.num_rows, "tokens": pending.batch.padded_tokens}
    prefix = f"{device}/" if device else ""
    compute_track = f"{prefix}compute{pending.stream}"
    for stage, start, end, track in (
        ("h2d", "h2d_start", "h2d_done", f"{prefix}copy"),
        ("compute", "compute_start", "compute_done", compute_track),
        ("d2h", "compute_done", "d2h_done", compute_track),
    ):
        timings.busy(stage, ev[start].time_ns(), ev[end].time_ns(), track, **args)
