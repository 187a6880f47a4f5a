"""The embedding job: rows -> tokenize -> plan -> stage -> execute -> write, on one or several devices.

`run_embed` settles the run's devices, model facts, output and reader, claims the output, then runs
the stage pipeline (overlapped, or its serial twin) and fills the report. A Ray replica runs the
same `execute_job` over the window range it is handed (replica.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

import torch

from ..config import RunConfig, resolve_plan
from ..device import Device, resolve_dtype
from ..errors import ConfigError, Interrupted
from ..files.arrivals import ArrivalReplay
from ..files.fingerprint import fingerprint
from ..files.part_format import settle_arrow
from ..files.parts import PartStore
from ..job.accounting import settle, watch_output
from ..job.claim import claimed, open_store, recorded_fingerprint
from ..job.output_checks import check_output, output_format
from ..job.signals import signals_stop
from ..models.checkpoint import CheckpointInfo
from ..models.int8_kernels import resumed_int8
from ..models.registry import load_model
from ..models.shelf import shelved
from ..obs.meter import COUNTER
from ..obs.progress import Progress
from ..place.affinity import device_spec, resolve_affinity, start_tokenizer_pool
from ..place.devices import make_run_devices
from .decode import image_budget
from .degrade import run_degrading
from .given import EmbedJob, RunExtras
from .options import embed_checkpoint, encoder_task
from .plan import max_padded_len
from .quantize import int8_model
from .read import Reader
from .report import RunReport
from .run import EmbedRun
from .tensor_parallel import refusal as tp_refusal
from .tensor_parallel import start_embedding_group


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
        devices = [device] if device is not None else make_run_devices(config.device)
    try:
        if len({d.kind for d in devices}) > 1:
            raise ConfigError(f"--devices: one kind of device per run (got {', '.join(d.kind for d in devices)})")
        config = replace(config, plan=resolve_plan(config.plan, devices[0].kind, config.input.rate))
        specs = [device_spec(str(d.torch_device), d.kind) for d in devices]
        if (affinity := resolve_affinity(config.device.cpu_affinity, specs)) is not None:
            start_tokenizer_pool(affinity.tokenize)  # NOTE: before anything tokenizes (the int8 check does)
        if len(devices) == 1:
            return run_embed_job(config, devices, extras)
        return run_degrading(config, devices, extras, run_embed_job)
    finally:
        if own_devices:
            for d in devices:
                d.close()


def run_embed_job(config: RunConfig, devices: list[Device], extras: RunExtras) -> RunReport:
    fmt = output_format(config.output.path, config.output.output_format)
    check_output(config.output.path)
    info = embed_checkpoint(config)
    if (spec := getattr(info.config, "image", None)) is not None:  # NOTE: batches of pixels (decode.py)
        config = image_budget(config, spec, devices[0].kind)
    max_length = check_lengths(config, info)
    reader = Reader(config.input, config.plan.sort_window)  # input problems surface here, before any work

    dtype = resolve_dtype(config.device.dtype, devices[0])
    if config.device.quantize in ("int8", "auto") and (recorded := recorded_fingerprint(config.output)) is not None:
        config = replace(config, device=resumed_int8(config.device, recorded))
    weights = "int8" if config.device.quantize == "int8" else "float"
    device = devices[0].torch_device
    key = ("encoder", str(info.path), str(device), str(dtype), max_length, repr(config.device))
    if extras.model is None and (weights == "int8" or (config.device.quantize == "auto" and devices[0].kind == "cpu")):
        model, check = shelved(extras.shelf, key, lambda: int8_model(config, info, device, dtype, max_length))
        extras = replace(extras, model=model, quantize=check.as_dict())
        weights = check.chosen
        if weights == "int8":  # NOTE: the kernel that ran, in the fingerprint and the report's config
            config = replace(config, device=replace(config.device, int8_kernel=check.engine))
    elif extras.model is None and extras.shelf is not None and config.device.tensor_parallel == 1:
        extras = replace(extras, model=extras.shelf.get(key, lambda: load_model(info, device, dtype)))
    if config.device.tensor_parallel > 1 and (why := tp_refusal(config, info, devices)) is not None:
        raise ConfigError(why)
    fp = embed_fingerprint(config, info, reader, max_length, dtype, weights)
    store = encoder_task(config).store(config, fmt, info, fp, reader.sources)
    with claimed(store, config.output):
        job = EmbedJob(config, devices, store, reader, info, max_length, dtype)
        return execute_tensor_parallel(job, extras) if config.device.tensor_parallel > 1 else execute_job(job, extras)


def execute_tensor_parallel(job: EmbedJob, extras: RunExtras) -> RunReport:
    """`--tp N` on a decoder embedder: the job's pipeline on rank 0's shard, ranks 1..N-1 beside it
    (tensor_parallel.py); the ranks are stopped however the run ends."""
    model, tp, threads = start_embedding_group(job.config, job.info, job.devices[0], job.dtype)
    if threads is not None:
        job.devices[0].threads = threads  # type: ignore[attr-defined]  # NOTE: rank 0's share of the cores
    try:
        report = execute_job(job, replace(extras, model=model))
    finally:
        ranks = tp.close(model.embedder.batches)  # type: ignore[attr-defined]
    report.tensor_parallel = [asdict(r) for r in ranks]
    return report


def execute_job(job: EmbedJob, extras: RunExtras) -> RunReport:
    """Runs the stage pipeline over the job's input (from its first uncommitted window) and reports."""
    store, reader, config = job.store, job.reader, job.config
    first_window = open_store(store, reader, config.output) if job.first_window is None else job.first_window
    run = EmbedRun(job, extras.progress or Progress(config.pipeline.progress), extras.stop)
    watch_output(run.progress.meter, store, run.rejects, store.rows_written + run.held_rows)
    run.timings.watch(run.progress.meter)
    run.progress.meter.probe("tokens.input", lambda: run.report.real_tokens, COUNTER, carry=True)
    run.report.quantize = dict(extras.quantize)
    try:
        stages, thread_init, planner, writer, budget = run.stages(first_window, extras.batch_profiler, extras.model)
        rate = config.input.rate
        settle_arrow()
        source = reader if rate is None else ArrivalReplay(reader.produce, rate, config.input.rate_seed, stop=run.stop)
        start, start_ns = time.perf_counter(), time.perf_counter_ns()
        with signals_stop(run.stop) as interrupted:
            run.pipeline(source, stages, thread_init, extras.hooks, extras.ranges)
        if interrupted:
            if writer.commit_every_ns:
                writer.checkpoint()  # NOTE: a stop, unlike a kill, keeps every row that landed
            done = store.rows_done if isinstance(store, PartStore) else store.rows_written
            raise Interrupted(interrupted[0], done, config.output.path)
        run.report.accounting = settle(
            ((c.path, c.read, c.resumed + writer.held_by_source.get(c.path, 0)) for c in reader.counts.values()),
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
    run.report.checkpoints = writer.checkpoints
    written_now = writer.rows_written - writer.rows_held  # NOTE: rows held by checkpoints count as resumed
    return run.finish(planner.windows, written_now, budget.tokens, start_ns, end_ns, extras.trace_marks)


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
    config: RunConfig, info: CheckpointInfo, reader: Reader, max_length: int, dtype: torch.dtype, weights: str = "float"
) -> dict:
    """Inputs and every option that changes which rows land in which part, or their values."""
    files = [s.path for s in reader.sources]
    options = {
        "max_length": max_length,
        "pooling": info.pooling.mode,
        "normalize": info.pooling.normalize,
        "dtype": str(dtype),
        "sort_window": config.plan.sort_window,
        "on_long": config.tokenize.on_long,
        "text_column": config.input.text_column,
        "id_column": config.input.id_column,
    }
    # NOTE: only when set, so a run started before these options existed still resumes
    extra = {"dimensions": info.pooling.dimensions, "prompt": info.prompt, "prompt_column": config.input.prompt_column}
    if (spec := getattr(info.config, "image", None)) is not None:  # NOTE: the images' column and how they are made
        extra["images"] = [config.input.image_column, repr(spec)]
    if weights != "float" and weights != "float32":  # NOTE: --quantize auto enters as what it chose
        extra["quantize"] = weights
    if weights == "int8":  # NOTE: two kernels round differently: a resumed run goes on with the one that began
        extra["int8_kernel"] = config.device.int8_kernel
    if config.backend == "transformers":
        extra["backend"] = config.backend
    extra |= encoder_task(config).fingerprint(config)
    return fingerprint(files, info.path, options | {k: v for k, v in extra.items() if v})
