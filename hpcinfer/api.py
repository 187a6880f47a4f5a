"""The library entry point: `run(RunConfig) -> RunReport`. The CLI is a thin shell over this."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from .accounting import settle
from .arrivals import ArrivalReplay
from .config import OutputConfig, RunConfig, flatten, resolve_plan
from .device import Device, make_device, resolve_dtype
from .dispatch import Dispatcher
from .errors import ConfigError, Interrupted
from .lock import OutputLock
from .models.checkpoint import CheckpointInfo, inspect_checkpoint
from .models.registry import LoadedModel, load_tokenizer, resolve_model_path
from .output import PartStore, fingerprint
from .pipeline import Fanout, run_overlapped, run_serial
from .plan import Planner, TokenBudget, max_padded_len
from .profile import RangeBackend
from .progress import Progress
from .read import Reader, estimate_rows
from .replicas import DeviceLog, ResultWait, build_replicas, device_labels, make_devices, parse_devices
from .report.latency import LatencyLog
from .report.summary import RunReport
from .report.timing import Timings, bottleneck
from .report.trace import write_trace
from .tokenize import TokenizeStage
from .types import Pending
from .write import RejectCounter, Writer, check_output, check_output_state, output_format

__all__ = ["Interrupted", "run"]


def run(
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
    """Embeds every valid input row and writes one output row per valid row, in input order.

    Rejected rows go to OUTPUT.rejects.jsonl. `device` overrides `config.device.device`, and
    `devices` (one replica each) `config.device.devices`: tests pass simulated or fault-injecting
    devices. `hooks` maps a stage name to a callable run before each item of that stage (fault
    injection in tests). `model`, already loaded for the (first) device and dtype, saves loading it
    again (tune's trials share one).
    """
    config.validate()
    if config.task != "embed":
        from .generate.job import run_generate, wants_generation

        if wants_generation(config):
            if config.cluster.engine == "ray":  # NOTE: imports Ray only here, as for embedding
                from .ray_engine.generate_driver import run_generate_on_ray

                return run_generate_on_ray(config, progress=progress)  # type: ignore[return-value]
            if batch_profiler is not None:
                raise ConfigError("--torch-profile records embedding batches; profile generation with nsys")
            return run_generate(config, progress=progress, ranges=ranges)  # type: ignore[return-value]
    if config.cluster.engine == "ray":  # NOTE: imports Ray only here, so the package works without it
        from .ray_engine.driver import run_on_ray

        return run_on_ray(config, progress=progress)
    own_devices = device is None and devices is None
    if devices is None:
        devices = [device] if device is not None else _make_devices(config)
    try:
        if len({d.kind for d in devices}) > 1:
            raise ConfigError(f"--devices: one kind of device per run (got {', '.join(d.kind for d in devices)})")
        config = replace(config, plan=resolve_plan(config.plan, devices[0].kind, config.input.rate))
        return _run(config, devices, progress, hooks, ranges, batch_profiler, model)
    finally:
        if own_devices:
            for d in devices:
                d.close()


def _make_devices(config: RunConfig) -> list[Device]:
    if not config.device.devices:
        return [make_device(config.device.device, config.device.streams)]
    specs = parse_devices(config.device.devices)
    return make_devices(specs, config.device.streams, config.device.threads)


def _run(
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
    max_length = _check_lengths(config, info)
    reader = Reader(config.input, config.plan.sort_window)  # input problems surface here, before any work

    dtype = resolve_dtype(config.device.dtype, devices[0])
    store = PartStore(
        config.output.path, fmt, info.config.hidden_size, _fingerprint(config, info, reader, max_length, dtype)
    )
    with _claimed(store, config.output.path):
        return _execute(
            _Job(config, devices, store, reader, info, max_length, dtype),
            progress,
            hooks,
            ranges,
            batch_profiler,
            preloaded,
        )


@dataclass(frozen=True, slots=True)
class _Job:
    """What start-up settled: the run's config, device, output store, reader and model facts."""

    config: RunConfig
    devices: list[Device]  # one replica each
    store: PartStore
    reader: Reader
    info: CheckpointInfo
    max_length: int
    dtype: torch.dtype
    # None: from the output's state (fresh, or resumed after the committed windows). A cluster
    # replica runs one window range and gives its first window here (see ray_engine/replica.py).
    first_window: int | None = None


@contextmanager
def _claimed(store: PartStore, output: str) -> Iterator[None]:
    """Holds the output's lock for the run; a run that fails before its first commit leaves no parts."""
    lock = OutputLock(store.dir, output).acquire()  # a second run on this output is refused here
    try:
        yield
    except BaseException:
        if not store.committed():  # nothing worth resuming: leave no trace
            shutil.rmtree(store.dir, ignore_errors=True)
        raise
    finally:
        lock.release()


def _execute(
    job: _Job,
    progress: Progress | None,
    hooks: Any,
    ranges: Any,
    batch_profiler: Any,
    preloaded: LoadedModel | None,
) -> RunReport:
    config, devices, store, reader, info = job.config, job.devices, job.store, job.reader, job.info
    max_length = job.max_length
    first_window = _open_store(store, reader, config.output) if job.first_window is None else job.first_window
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


def _check_lengths(config: RunConfig, info: CheckpointInfo) -> int:
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


def _open_store(store: PartStore, reader: Reader, output: OutputConfig) -> int:
    """Starts a fresh parts directory, or picks up a previous run's: returns the first window to do."""
    committed = store.committed()
    check_output_state(output.path, output.overwrite, output.resume, committed)
    store.remove_stale_temporaries()
    if output.resume and committed:
        store.load()
        reader.skip_rows = store.rows_committed
        reader.remember_ids(store.committed_ids())
        return len(store.windows)
    store.start_fresh()
    return 0


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
