"""The library entry point: `run(RunConfig) -> RunReport`. The CLI is a thin shell over this."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import RunConfig, flatten
from .device import Device, OutputPool, StagingRing, make_device, resolve_dtype
from .errors import ConfigError
from .execute import Executor
from .models.checkpoint import inspect_checkpoint
from .models.registry import load_model, load_tokenizer, resolve_model_path
from .pipeline import run_overlapped, run_serial
from .plan import Planner, round_up
from .progress import Progress
from .read import Reader, estimate_rows
from .report.summary import RunReport
from .report.timing import Timings, bottleneck
from .report.trace import write_trace
from .stage import StageStep
from .tokenize import TokenizeStage
from .types import Pending
from .write import Writer, check_output, output_format


def run(
    config: RunConfig,
    *,
    device: Device | None = None,
    progress: Progress | None = None,
    hooks: dict[str, Callable[[Any], None]] | None = None,
) -> RunReport:
    """Embeds every input row and writes one output row per input row, in input order.

    `device` overrides `config.device.device` (tests pass a simulated device); `hooks` maps a
    stage name to a callable run before each item of that stage (fault injection in tests).
    """
    config.validate()
    reader = Reader(config.input)  # input problems surface here, before any work
    fmt = output_format(config.output.path, config.output.output_format)
    check_output(config.output.path, config.output.overwrite)
    info = inspect_checkpoint(resolve_model_path(config.model))
    max_length = config.tokenize.max_length or info.max_seq_length
    if max_length > info.config.max_position_embeddings:
        raise ConfigError(
            f"--max-length {max_length} exceeds the model's {info.config.max_position_embeddings} positions"
        )
    if round_up(max_length, config.plan.pad_multiple) > config.plan.max_batch_tokens:
        raise ConfigError(
            f"--max-batch-tokens {config.plan.max_batch_tokens} cannot hold one row of {max_length} tokens"
        )

    if config.device.threads:
        torch.set_num_threads(config.device.threads)
    own_device = device is None
    device = device or make_device(config.device.device, config.device.streams)
    dtype = resolve_dtype(config.device.dtype, device)
    stop = threading.Event()
    timings = Timings(keep_spans=config.trace_path is not None)
    report = RunReport(device=device.kind, dtype=str(dtype).removeprefix("torch."), model=str(info.path))
    progress = progress or Progress(config.pipeline.progress)
    progress.set_total(estimate_rows(reader.sources) or 0)
    writer: Writer | None = None
    try:
        model = load_model(info, device.torch_device, dtype)
        plan = config.plan
        ring = StagingRing(device, config.device.staging_buffers, plan.max_batch_tokens, plan.max_batch_size, stop)
        outputs = OutputPool(
            device,
            config.device.staging_buffers + config.device.streams,
            plan.max_batch_size,
            model.embedder.output_dim,
            stop,
        )

        def on_batch(pending: Pending) -> None:
            _record_device_spans(timings, pending)
            batch = pending.batch
            report.batches += 1
            report.real_tokens += batch.real_tokens
            report.padded_tokens += batch.padded_tokens
            progress.advance(batch.num_rows, batch.real_tokens)

        writer = Writer(config.output.path, fmt, model.embedder.output_dim, outputs, on_batch)
        tokenize = _CountingTokenizer(load_tokenizer(info.path, max_length), max_length, report)
        stages = [
            tokenize,
            Planner(plan),
            StageStep(device, ring),
            Executor(device, model.embedder, ring, outputs),
            writer,
        ]
        start = time.perf_counter()
        if config.pipeline.overlap:
            run_overlapped(
                reader,
                stages,
                timings,
                queue_depth=config.pipeline.queue_depth,
                workers={"tokenize": config.tokenize.threads},
                stop=stop,
                hooks=hooks,
            )
        else:
            run_serial(reader, stages, timings, stop=stop, hooks=hooks)
        writer.commit()
        report.wall_s = time.perf_counter() - start
    except BaseException:
        stop.set()
        if writer is not None:
            writer.abort()
        raise
    finally:
        progress.close()
        if own_device:
            device.close()

    report.rows = writer.rows_written
    report.windows = stages[1]._window_id  # type: ignore[attr-defined]
    report.output = config.output.path
    report.stages = timings.summary(report.wall_s)
    report.bottleneck, report.hint = bottleneck(report.stages, synchronous_device=device.kind == "cpu")
    report.peak_device_memory_bytes = device.peak_memory_bytes()
    report.config = flatten(config)
    if config.report_path:
        report.write_json(config.report_path)
    if config.trace_path:
        write_trace(timings.spans, config.trace_path)
    return report


class _CountingTokenizer(TokenizeStage):
    """The tokenize stage, also counting truncated rows into the report."""

    def __init__(self, tokenizer: Any, max_length: int, report: RunReport) -> None:
        super().__init__(tokenizer, max_length)
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


def default_output_name(inputs: tuple[str, ...]) -> str:
    return str(Path(inputs[0]).with_suffix("")) + ".embeddings.parquet"
