"""One embedding run's moving parts, between start-up and the report: the devices' replicas and
their pipeline stages, the dispatcher, the report filled as batches land, the hang watchdog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import flatten
from ..device.threads import set_torch_threads
from ..errors import DeviceHung
from ..files.sources import estimate_rows
from ..job.accounting import books
from ..job.rejects import RejectCounter
from ..models.registry import LoadedModel, load_tokenizer
from ..obs.latency import LatencyLog
from ..obs.progress import Progress
from ..obs.timing import Span, Timings, bottleneck, write_trace
from ..place.affinity import device_spec, pinned, resolve_affinity
from ..place.devices import device_labels
from ..place.dispatch import Dispatcher
from .decode import DecodeStage, decode_threads
from .given import EmbedJob
from .held import Held, load_held
from .overlap import Fanout, run_overlapped
from .plan import Planner, TokenBudget, max_padded_len
from .replicas import DeviceLog, ResultWait, build_replicas
from .report import RunReport
from .serial import run_serial
from .tokenize import TokenizeStage
from .types import Pending
from .write import Writer


class EmbedRun:
    """One embedding run's moving parts: its devices' replicas, the report it fills as batches land,
    the dispatcher and the per-device log."""

    def __init__(self, job: EmbedJob, progress: Progress, stop: threading.Event | None = None) -> None:
        self.job, self.config, self.progress = job, job.config, progress
        devices = job.devices
        self.labels = device_labels([str(d.torch_device) if d.kind == "cuda" else d.kind for d in devices])
        shown = devices[0].kind if len(devices) == 1 else ", ".join(self.labels)
        self.report = RunReport(device=shown, dtype=str(job.dtype).removeprefix("torch."), model=str(job.info.path))
        self.stop = stop or threading.Event()
        self.timings = Timings(keep_spans=self.config.trace_path is not None)
        self.commit_every_s, self.held = self.checkpoints()
        self.held_rows = held = sum(len(h.rows) for h in self.held.values())  # NOTE: taken back, not computed
        progress.set_total(max((estimate_rows(job.reader.sources) or 0) - job.reader.skip_rows - held, 0))
        progress.set_devices(self.labels)  # NOTE: also one device, after a restart on fewer: its rows are its own
        if self.config.device.threads and len(devices) == 1:
            set_torch_threads(self.config.device.threads)
        output = self.config.output
        self.rejects = RejectCounter(output.max_rejects, output.max_reject_fraction)
        self.device_log = DeviceLog(self.labels)
        self.dispatcher = Dispatcher(len(devices), self.config.device.dispatch)
        self.latency = LatencyLog()
        self.affinity = resolve_affinity(
            self.config.device.cpu_affinity, [device_spec(str(d.torch_device), d.kind) for d in devices]
        )
        self.report.cpu_affinity = self.affinity.describe() if self.affinity is not None else ""

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
        held, every = self.held, self.commit_every_s
        writer = Writer(
            job.store, outputs, self.rejects, first_window, self.on_batch, self.latency, commit_every_s=every, held=held
        )
        tokenize: Any
        if (spec := getattr(info.config, "image", None)) is not None:  # NOTE: an image run decodes instead
            tokenize = DecodeStage(spec, decode_threads(config), config.input.image_files)
        else:
            tokenizer = load_tokenizer(info.path, job.max_length)
            vocab, on_long = info.config.vocab_size, config.tokenize.on_long
            tokenize = _CountingTokenizer(tokenizer, job.max_length, vocab, on_long, self.report, info.prompt)
        online, timeout = config.input.rate is not None, plan.batch_timeout_ms
        planner = Planner(
            plan,
            budget,
            first_window,
            self.rejects.add,
            online=online,
            timeout_ms=timeout,
            max_width=max_width,
            held=held,
        )
        # NOTE: the serial twin has one thread for every stage: pipeline() pins the whole process
        pin = self.affinity if config.pipeline.overlap else None
        if len(replicas) == 1:
            only = replicas[0]
            init = only.device.bind_thread if pin is None else pin.thread_init(only.device.bind_thread)
            return [tokenize, planner, only.stage, only.executor, writer], init, planner, writer, budget
        binds = [r.device.bind_thread for r in replicas]
        fan = Fanout(
            "dispatch",
            lambda batch: self.dispatcher.choose(batch.padded_tokens, batch.num_rows),
            [[r.stage, r.executor, ResultWait()] for r in replicas],
            binds if pin is None else [pin.thread_init(b, i) for i, b in enumerate(binds)],
            self.labels,
        )
        shared = None if pin is None else pin.thread_init()
        return [tokenize, planner, fan, writer], shared, planner, writer, budget

    def checkpoints(self) -> tuple[float, dict[int, Held]]:
        """(--commit-every in seconds, 0 for none; the rows an interrupted run's checkpoints hold).

        NOTE: only where windows are the same in every run over the input (a held row is known by
        its window and its place in it): not under --rate or --batch-timeout-ms, whose windows
        close on the clock (they are about a batch each, committed at once), and not in a cluster
        replica, which commits into the driver's store.
        """
        job, config = self.job, self.config
        if job.first_window is not None or config.input.rate is not None or config.plan.batch_timeout_ms is not None:
            return 0.0, {}
        return config.output.commit_every_s, load_held(job.store)

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
        elif self.affinity is not None:
            # NOTE: one thread does everything, so the process takes the compute cores: every thread,
            # since torch's were started (with the old cores) while the model loaded
            compute = sorted({core for r in self.affinity.replicas for core in r.compute})
            with pinned(compute, whole_process=True):
                run_serial(source, stages, self.timings, **common)
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

    def finish(
        self, windows: int, written_now: int, final_tokens: int, start_ns: int, end_ns: int, marks: Sequence[Span] = ()
    ) -> RunReport:
        """The report's closing figures; written as JSON (--report) and the trace (--trace)."""
        report, config, devices, store = self.report, self.config, self.job.devices, self.job.store
        report.rows = store.rows_written
        report.rows_resumed = store.rows_written - written_now
        books(report)  # NOTE: the rows resumed as the accounting counts them: input rows, rejects included
        report.windows = windows
        report.rejects = dict(sorted(self.rejects.by_reason.items()))
        report.final_max_batch_tokens = final_tokens
        report.output = config.output.path
        report.stages = self.timings.summary(report.wall_s)
        self.progress.meter.facts["stage_workers"] = self.timings.workers()
        report.bottleneck, report.hint = bottleneck(
            report.stages,
            synchronous_device=devices[0].kind == "cpu",
            wall_s=report.wall_s,
            output_format=getattr(store, "fmt", None),
        )
        peaks = [p for d in devices if (p := d.peak_memory_bytes()) is not None]
        report.peak_device_memory_bytes = sum(peaks) if peaks else None
        report.devices = self.device_log.summary(start_ns, end_ns)
        report.batch_latency_ms = self.latency.batch_summary()
        report.arrivals = self.latency.request_summary(config.input.rate)
        report.config = flatten(config)
        if config.trace_path:
            write_trace([*self.timings.spans, *marks], config.trace_path)
        return report


class _CountingTokenizer(TokenizeStage):
    """The tokenize stage, also counting truncated rows into the report."""

    def __init__(
        self, tokenizer: Any, max_length: int, vocab: int, on_long: str, report: RunReport, prompt: str = ""
    ) -> None:
        super().__init__(tokenizer, max_length, vocab, on_long, prompt)
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
