"""The embedding job: rows -> tokenize -> plan -> stage -> execute -> write, on one or several devices.

`run_embed` settles the run's devices, model facts, output and reader, claims the output, then runs
the stage pipeline (overlapped, or its serial twin) and fills the report. A Ray replica runs the
same `execute_job` over the window range it is handed (replica.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ...config import RunConfig, flatten, resolve_plan
from ...device import Device, resolve_dtype
from ...errors import ConfigError, DeviceHung, DevicesFailed, HpcinferError, Interrupted, StageError
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
from ...place.breaker import Breaker, BreakerLog, BreakerSettings
from ...place.devices import device_labels, make_run_devices
from ...place.dispatch import Dispatcher
from ...types import Pending
from .plan import Planner, TokenBudget, max_padded_len
from .replicas import DeviceLog, ResultWait, build_replicas
from .report import RunReport
from .tokenize import TokenizeStage
from .write import Writer


@dataclass(frozen=True, slots=True)
class RunExtras:
    """What a caller adds to an embedding run besides its config (see `api.run`)."""

    progress: Progress | None = None
    hooks: dict[str, Callable[[Any], None]] | None = None  # stage name -> called before each item (tests)
    ranges: RangeBackend | None = None  # a profiler range per work item (hpcinfer profile)
    batch_profiler: Any = None  # torch.profiler over a few batches
    model: LoadedModel | None = None  # loaded already for the (first) device and dtype


def run_embed(
    config: RunConfig,
    extras: RunExtras = RunExtras(),  # noqa: B008 - frozen, so one shared default is safe
    *,
    device: Device | None = None,
    devices: list[Device] | None = None,
) -> RunReport:
    """Embeds every valid input row on this machine's devices (`device`/`devices` override the config's)."""
    config.validate()
    own_devices = device is None and devices is None
    if devices is None:
        devices = [device] if device is not None else make_run_devices(config)
    try:
        if len({d.kind for d in devices}) > 1:
            raise ConfigError(f"--devices: one kind of device per run (got {', '.join(d.kind for d in devices)})")
        config = replace(config, plan=resolve_plan(config.plan, devices[0].kind, config.input.rate))
        if len(devices) == 1:
            return run_embed_job(config, devices, extras)
        return _run_degrading(config, devices, extras)
    finally:
        if own_devices:
            for d in devices:
                d.close()


DEVICE_STAGES = ("stage", "execute", "collect")  # a device's steps; tokenize, plan and write are the host's


def _run_degrading(config: RunConfig, devices: list[Device], extras: RunExtras) -> RunReport:
    """Several devices: a device fault ends the pipeline, not the run. The fault counts against
    the device's breaker, and the run resumes from its committed windows on the devices whose
    breakers let them work (a breaker past its cool-down gives its device a trial at such a
    restart, renewed in place in `devices`); the rows of the uncommitted windows are redone
    there, exactly as `--resume` redoes them, so the output is the one an undisturbed run
    writes. The run fails only when every device is out, naming each."""
    labels = device_labels([str(d.torch_device) if d.kind == "cuda" else d.kind for d in devices])
    settings = BreakerSettings(
        config.device.breaker_failures, config.device.breaker_window, config.device.breaker_cooldown
    )
    progress = extras.progress or Progress(config.pipeline.progress)
    log = BreakerLog(listener=lambda t: progress.note(f"hpcinfer: device {t.device} {t.state}: {t.reason}"))
    breakers = [Breaker(label, settings, log) for label in labels]
    extras = replace(extras, progress=progress)
    restarts: list[dict[str, Any]] = []
    faulted: set[int] = set()  # devices that failed since they last ran
    while True:
        live = [i for i, b in enumerate(breakers) if b.available()]
        for i in faulted.intersection(live):  # NOTE: with fresh streams: an error on a stream is sticky
            devices[i] = devices[i].renew()
            faulted.discard(i)
        if not live:
            raise DevicesFailed({f"device@{b.device}": b.last_error for b in breakers}, RuntimeError(log.transitions))
        try:
            report = run_embed_job(config, [devices[i] for i in live], extras)
        except StageError as exc:
            local = device_labels([labels[i] for i in live])  # NOTE: a run on fewer devices numbers them anew
            stage, _, where = exc.stage.partition("@")
            if len(live) == 1 and stage in DEVICE_STAGES:
                where = local[0]  # one device: its stages carry no device name
            if isinstance(exc.cause, HpcinferError) or where not in local:
                raise  # a user's problem, or a stage that is not a device's
            failed = live[local.index(where)]
            error = f"{type(exc.cause).__name__}: {exc.cause}"
            if isinstance(exc.cause, DeviceHung):
                breakers[failed].trip(error)  # NOTE: a hung device is out at once
            else:
                breakers[failed].failure(error)
            faulted.add(failed)
            restarts.append({"device": labels[failed], "error": error, "committed_rows": _committed_rows(config)})
            # NOTE: from here the output is this run's own: resume it, never overwrite it
            config = replace(config, output=replace(config.output, resume=True, overwrite=False))
            continue
        for i in live:
            breakers[i].success()  # NOTE: a device on trial that saw the run through is back
        report.device_faults = [asdict(t) for t in log.transitions]
        report.restarts = restarts
        return report


def _committed_rows(config: RunConfig) -> int:
    """Rows the output's committed windows hold (its manifest), 0 before the first commit."""
    manifest = Path(f"{config.output.path}.parts") / "manifest.json"
    try:
        return sum(w["rows"] for w in json.loads(manifest.read_text())["windows"])
    except (OSError, ValueError, KeyError):
        return 0


def run_embed_job(config: RunConfig, devices: list[Device], extras: RunExtras) -> RunReport:
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
        return execute_job(EmbedJob(config, devices, store, reader, info, max_length, dtype), extras)


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


def execute_job(job: EmbedJob, extras: RunExtras) -> RunReport:
    """Runs the stage pipeline over the job's input (from its first uncommitted window) and reports."""
    store, reader, config = job.store, job.reader, job.config
    first_window = open_store(store, reader, config.output) if job.first_window is None else job.first_window
    run = _EmbedRun(job, extras.progress or Progress(config.pipeline.progress))
    try:
        stages, thread_init, planner, writer, budget = run.stages(first_window, extras.batch_profiler, extras.model)
        rate = config.input.rate
        source = reader if rate is None else ArrivalReplay(reader.produce, rate, config.input.rate_seed, stop=run.stop)
        start, start_ns = time.perf_counter(), time.perf_counter_ns()
        with signals_stop(run.stop) as interrupted:
            run.pipeline(source, stages, thread_init, extras.hooks, extras.ranges)
        if interrupted:
            raise Interrupted(interrupted[0], store.rows_written, config.output.path)
        run.report.accounting = settle(
            ((c.path, c.read, c.resumed) for c in reader.counts.values()),
            writer.written_by_source,
            run.rejects.by_source,
        )
        end_ns = time.perf_counter_ns()
        store.assemble()
        run.report.wall_s = time.perf_counter() - start
    except BaseException:
        run.stop.set()
        raise
    finally:
        run.progress.close()
    return run.finish(planner.windows, writer.rows_written, budget.tokens, start_ns, end_ns)


class _EmbedRun:
    """One embedding run's moving parts: its devices' replicas, the report it fills as batches land,
    the dispatcher and the per-device log."""

    def __init__(self, job: EmbedJob, progress: Progress) -> None:
        self.job, self.config, self.progress = job, job.config, progress
        devices = job.devices
        self.labels = device_labels([str(d.torch_device) if d.kind == "cuda" else d.kind for d in devices])
        shown = devices[0].kind if len(devices) == 1 else ", ".join(self.labels)
        self.report = RunReport(device=shown, dtype=str(job.dtype).removeprefix("torch."), model=str(job.info.path))
        self.stop = threading.Event()
        self.timings = Timings(keep_spans=self.config.trace_path is not None)
        progress.set_total(max((estimate_rows(job.reader.sources) or 0) - job.reader.skip_rows, 0))
        if len(devices) > 1:
            progress.set_devices(self.labels)
        if self.config.device.threads and len(devices) == 1:
            torch.set_num_threads(self.config.device.threads)
        output = self.config.output
        self.rejects = RejectCounter(output.max_rejects, output.max_reject_fraction)
        self.device_log = DeviceLog(self.labels)
        self.dispatcher = Dispatcher(len(devices), self.config.device.dispatch)
        self.latency = LatencyLog()

    def stages(self, first_window: int, batch_profiler: Any, preloaded: LoadedModel | None) -> tuple:
        """(stages, thread_init, planner, writer, budget): tokenize, plan, each device's stage and
        execute (a Fanout over several devices), write."""
        job, config, plan, info = self.job, self.config, self.config.plan, self.job.info
        max_width = max_padded_len(job.max_length, plan.pad_multiple, info.config.max_position_embeddings)
        budget = TokenBudget(plan.max_batch_tokens, max_width)
        replicas = build_replicas(
            config, job.devices, self.labels, info, job.dtype, budget, max_width, self.stop, batch_profiler, preloaded
        )
        outputs = [r.outputs for r in replicas]
        writer = Writer(job.store, outputs, self.rejects, first_window, self.on_batch, self.latency)
        tokenizer = load_tokenizer(info.path, job.max_length)
        vocab, on_long = info.config.vocab_size, config.tokenize.on_long
        tokenize = _CountingTokenizer(tokenizer, job.max_length, vocab, on_long, self.report)
        online, timeout = config.input.rate is not None, plan.batch_timeout_ms
        planner = Planner(
            plan, budget, first_window, self.rejects.add, online=online, timeout_ms=timeout, max_width=max_width
        )
        if len(replicas) == 1:
            only = replicas[0]
            return (
                [tokenize, planner, only.stage, only.executor, writer],
                only.device.bind_thread,
                planner,
                writer,
                budget,
            )
        fan = Fanout(
            "dispatch",
            lambda batch: self.dispatcher.choose(batch.padded_tokens, batch.num_rows),
            [[r.stage, r.executor, ResultWait()] for r in replicas],
            [r.device.bind_thread for r in replicas],
            self.labels,
        )
        return [tokenize, planner, fan, writer], None, planner, writer, budget

    def on_batch(self, pending: Pending) -> None:
        """A batch's results are written: its device time, tokens and rows into the report."""
        batch, report = pending.batch, self.report
        compute_ns = 0
        if pending.out is not None:
            labels = self.labels
            _record_device_spans(self.timings, pending, labels[pending.replica] if len(labels) > 1 else "")
            ev = pending.out.events
            compute_ns = ev["compute_done"].time_ns() - ev["compute_start"].time_ns()
            done_ns = ev["d2h_done"].time_ns()
            self.device_log.batch_done(pending.replica, batch.num_rows, batch.padded_tokens, compute_ns, done_ns)
            report.batches += 1
            report.oom_splits += pending.splits[0]
        self.dispatcher.done(pending.replica, batch.padded_tokens, compute_ns / 1e9)
        report.real_tokens += batch.real_tokens
        report.padded_tokens += batch.padded_tokens
        self.progress.advance(batch.num_rows, batch.real_tokens, device=pending.replica)

    def pipeline(self, source: Any, stages: list[Any], thread_init: Any, hooks: Any, ranges: Any) -> None:
        """The stages over the source: overlapped, or the serial twin (--no-overlap)."""
        config, common = self.config, {"stop": self.stop, "hooks": hooks, "ranges": ranges, "thread_init": thread_init}
        if config.pipeline.overlap:
            workers = {"tokenize": config.tokenize.threads}
            timeout = config.device.step_timeout
            watchdog = self.hang_watch(timeout) if timeout and len(self.labels) > 1 else None
            run_overlapped(
                source,
                stages,
                self.timings,
                queue_depth=config.pipeline.queue_depth,
                workers=workers,
                watchdog=watchdog,
                **common,
            )
        else:
            run_serial(source, stages, self.timings, **common)

    def hang_watch(self, timeout_s: float) -> Callable[[], tuple[str, BaseException] | None]:
        """A watchdog for the pipeline: a device with work outstanding and no batch written for
        `timeout_s` is hung (its stage is named, as a device fault, for the breakers)."""
        loads, stats = self.dispatcher.loads, self.device_log.stats
        since = [time.perf_counter_ns()] * len(loads)  # when each device last made progress or was idle

        def watch() -> tuple[str, BaseException] | None:
            now = time.perf_counter_ns()
            for i, (load, s) in enumerate(zip(loads, stats, strict=True)):
                if load.outstanding <= 0:
                    since[i] = now
                elif now - max(since[i], s.last_done_ns) > timeout_s * 1e9:
                    error = DeviceHung(f"no batch finished in {timeout_s:g} s (--step-timeout)")
                    return f"execute@{self.labels[i]}", error
            return None

        return watch

    def finish(self, windows: int, written_now: int, final_tokens: int, start_ns: int, end_ns: int) -> RunReport:
        """The report's closing figures; written as JSON (--report) and the trace (--trace)."""
        report, config, devices, store = self.report, self.config, self.job.devices, self.job.store
        report.rows = store.rows_written
        report.rows_resumed = store.rows_written - written_now
        report.windows = windows
        report.rejects = dict(sorted(self.rejects.by_reason.items()))
        report.final_max_batch_tokens = final_tokens
        report.output = config.output.path
        report.stages = self.timings.summary(report.wall_s)
        report.bottleneck, report.hint = bottleneck(report.stages, synchronous_device=devices[0].kind == "cpu")
        peaks = [p for d in devices if (p := d.peak_memory_bytes()) is not None]
        report.peak_device_memory_bytes = sum(peaks) if peaks else None
        report.devices = self.device_log.summary(start_ns, end_ns)
        report.batch_latency_ms = self.latency.batch_summary()
        report.arrivals = self.latency.request_summary(config.input.rate)
        report.config = flatten(config)
        if config.report_path:
            report.write_json(config.report_path)
        if config.trace_path:
            write_trace(self.timings.spans, config.trace_path)
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
