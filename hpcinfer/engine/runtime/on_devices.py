"""Generation on several devices (or tensor-parallel groups): an engine thread each behind the
dispatching pool (pool.py), their circuit breakers, and what the report says of them after."""

from __future__ import annotations

import queue
import threading
from dataclasses import asdict
from typing import Any

import torch

from ...obs.profile import RangeBackend
from ...place.breaker import CLOSED, BreakerLog, BreakerSettings
from ..engine import Engine
from .devices import EngineWorker
from .loop import run_loop
from .pool import EnginePool


def run_on_devices(
    job: Any, engines: list[Engine], source: Any, stop: threading.Event, ranges: RangeBackend | None
) -> None:
    """Feeds the engines' threads and commits what they finish (`job`: a GenerationJob); the first device
    failure stops the run."""
    cpus = sum(d.type == "cpu" for d in job.devices) * job.tp_size  # NOTE: with --tp, each rank's share
    threads = max(1, (job.config.device.threads or torch.get_num_threads()) // cpus) if cpus else None
    outbox: Any = queue.Queue()
    workers = []
    for i, (label, engine) in enumerate(zip(job.labels, engines, strict=True)):
        cores = job.affinity.replicas[i].compute if job.affinity is not None else None
        own = threads  # NOTE: a CPU engine pinned without --threads takes one thread per core of its share
        if cores is not None and threads is not None and not job.config.device.threads:
            own = len(cores)
        workers.append(EngineWorker(i, label, engine, outbox, own, job.step_hooks.get(label), ranges, cores))
    prefix_block = job.engine_config.block_size if job.engine_config.prefix_cache else None
    d = job.config.device
    breaker = BreakerSettings(d.breaker_failures, d.breaker_window, d.breaker_cooldown)
    pool = EnginePool(workers, d.dispatch, prefix_block, breaker, d.step_timeout)
    pool.breaker_log.listener = lambda t: job.progress.breaker(
        t.device, t.state, f"hpcinfer: device {t.device} {t.state} at {t.at_s:.1f} s: {t.reason}"
    )
    job.breaker_start = pool.breaker_log.start
    job.progress.set_devices(job.labels)
    try:
        pool.start()
        run_loop(job.admission, source, pool, job.finish, stop=stop, after=job.commit_ready)
    finally:
        pool.close()
        job.report.device_faults = [asdict(t) for t in pool.breaker_log.transitions]
        job.report.moved_prompts = {w.label: n for w, n in zip(workers, pool.moved, strict=True) if n}
        job.report.share_after_recovery = share_after_recovery(pool.breaker_log, job.finished_at, job.labels)
    for counts, worker in zip(job.by_device, workers, strict=True):
        counts.last_step_end = worker.stats.last_step_end


def share_after_recovery(
    log: BreakerLog, finished_at: list[tuple[float, int, int]], labels: list[str]
) -> dict[str, float]:
    """Per device whose breaker closed again: its share of the tokens generated since then
    (`finished_at`: (finish time, device index, completion tokens) per finished request)."""
    shares = {}
    for t in log.transitions:
        if t.state != CLOSED:
            continue
        since = log.start + t.at_s
        after = [(device, tokens) for at, device, tokens in finished_at if at >= since]
        total = sum(tokens for _, tokens in after)
        mine = sum(tokens for device, tokens in after if labels[device] == t.device)
        shares[t.device] = round(mine / total, 4) if total else 0.0
    return shares
