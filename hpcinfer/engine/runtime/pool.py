"""The pool of engine workers generation runs on several devices: which device gets a prompt, what
comes back, and what moves when a device fails (see devices.py for the whole picture).

`run_on_devices` runs generation on several devices (or tensor-parallel groups): an engine thread
each behind the pool, their circuit breakers, and what the report says of them after.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from ...errors import DevicesFailed, HpcinferError, StageError
from ...obs.profile import RangeBackend
from ...place.breaker import CLOSED, Breaker, BreakerLog, BreakerSettings, DeviceFault
from ...place.dispatch import POLICIES, soonest
from ..engine import Engine
from ..kvcache.block_manager import prefix_keys
from ..sequence import SamplingParams, Sequence
from .devices import EngineWorker, Prompt
from .loop import IDLE_WAIT_S, run_loop

PREFIX_MEMORY = 1 << 16  # prefix keys remembered for dispatch, least recently given forgotten first


class EnginePool:
    """What admission feeds with several devices: `add` dispatches, `finished` collects, `queued` bounds."""

    def __init__(
        self,
        workers: list[EngineWorker],
        policy: str = "tokens",
        prefix_block: int | None = None,
        breaker: BreakerSettings | None = None,
        step_timeout: float | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.workers = workers
        self.policy = policy
        self.outbox = workers[0].outbox
        self.in_flight = 0  # sequences added and not yet collected
        self.prefix_block = prefix_block  # the KV block size with prefix caching on, else None
        self._homes: OrderedDict[bytes, int] = OrderedDict()  # prefix key -> the device last given it
        self._next = 0
        self.breaker_log = BreakerLog()
        self.breakers = [Breaker(w.label, breaker or BreakerSettings(), self.breaker_log) for w in workers]
        self.step_timeout = step_timeout
        self.moved = [0] * len(workers)  # prompts moved away from each device after its faults
        self._ledger: list[dict[int, Prompt]] = [{} for _ in workers]  # sent, not finished: by seq id
        self._ids = iter(range(-1, -(1 << 62), -1))  # seq ids for prompts given none (never a row number)

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def close(self) -> None:
        for w in self.workers:
            w.close()

    @property
    def queued(self) -> int:
        return sum(w.queued for w in self.workers)

    @property
    def has_work(self) -> bool:
        return self.in_flight > 0

    def add(
        self, tokens: list[int], params: SamplingParams, tag: Any = None, seq_id: int | None = None, priority: int = 0
    ) -> None:
        prompt = Prompt(list(tokens), params, tag, next(self._ids) if seq_id is None else seq_id, priority)
        # NOTE: the last token is always computed, so only blocks before it can be found cached
        keys = prefix_keys(prompt.tokens, self.prefix_block, len(tokens) - 1) if self.prefix_block else []
        chosen = self.choose(prompt.charge, self._known_prefix(keys))
        self._send(chosen, prompt)
        self.in_flight += 1
        for key in keys:
            self._homes[key] = chosen
            self._homes.move_to_end(key)
        while len(self._homes) > PREFIX_MEMORY:
            self._homes.popitem(last=False)

    def _send(self, device: int, prompt: Prompt) -> None:
        assert prompt.seq_id is not None
        self._ledger[device][prompt.seq_id] = prompt
        self.workers[device].submit(prompt)

    def _known_prefix(self, keys: list[bytes]) -> dict[int, int]:
        """{device: prompt tokens it was last given with this prompt's longest known prefix}."""
        for depth in range(len(keys), 0, -1):
            if (home := self._homes.get(keys[depth - 1])) is not None:
                return {home: depth * (self.prefix_block or 0)}
        return {}

    def choose(self, charge: int, cached: dict[int, int] | None = None) -> int:
        """The device for a prompt of `charge` tokens (prompt + max_tokens); `cached[i]` of them device i may hold."""
        live = [i for i, b in enumerate(self.breakers) if b.available()]
        if not live:
            self._fail()
        if self.policy == "round_robin":
            while self._next not in live:
                self._next = (self._next + 1) % len(self.workers)
            chosen, self._next = self._next, (self._next + 1) % len(self.workers)
            return chosen
        workers = [self.workers[i] for i in live]
        outstanding, rates = [w.outstanding for w in workers], [w.rate for w in workers]
        held = {live.index(i): n for i, n in (cached or {}).items() if i in live}
        return live[soonest(outstanding, rates, [w.sent > 0 for w in workers], charge, held)]

    def _fail(self) -> None:
        """Every breaker is open: the run ends, naming each device and its last error."""
        raise DevicesFailed(
            {f"engine@{b.device}": b.last_error for b in self.breakers},
            RuntimeError(self.breakers[-1].last_error),
        )

    def _move(self, device: int, seq_ids: list[int]) -> None:
        """Sends these prompts of `device` (and, when its breaker is open, all it has queued) elsewhere."""
        ledger = self._ledger[device]
        prompts = [ledger.pop(i) for i in seq_ids if i in ledger]
        if not self.breakers[device].available():
            taken = self.workers[device].withdraw()
            prompts += [ledger.pop(p.seq_id) for p in taken if p.seq_id in ledger]  # type: ignore[arg-type]
        for prompt in prompts:
            self._send(self.choose(prompt.charge), prompt)
        self.moved[device] += len(prompts)

    def _watch(self) -> None:
        """A step past `step_timeout` is a hang: its device is opened and all it holds moves elsewhere."""
        if self.step_timeout is None:
            return
        now = time.perf_counter()
        for i, worker in enumerate(self.workers):
            started = worker.step_started
            if started is not None and now - started > self.step_timeout and self._ledger[i]:
                worker.abandon()
                self.breakers[i].trip(f"a step ran past --step-timeout {self.step_timeout:g} s")
                self._move(i, list(self._ledger[i]))

    def collect(self, wait: float | None) -> Iterator[tuple[int, list[Sequence]]]:
        """What the loop takes (see loop.py): the devices' finished sequences, waiting up to `wait`."""
        return self.finished(IDLE_WAIT_S if wait is None else wait)

    def finished(self, timeout: float) -> Iterator[tuple[int, list[Sequence]]]:
        """(device index, sequences) as they finish: waits up to `timeout` for the first, then takes what is there.

        A device fault moves that device's work elsewhere (see the module's docstring); a user
        error raises as itself, anything else outside a step as a StageError naming the device,
        and faults on every device as DevicesFailed.
        """
        self._watch()
        try:
            item = self.outbox.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            index, got = item
            if isinstance(got, DeviceFault):
                self.breakers[index].failure(got.error)
                self._move(index, got.dropped)
            elif isinstance(got, BaseException):
                if isinstance(got, HpcinferError):
                    raise got
                raise StageError(f"engine@{self.workers[index].label}", got) from got
            else:
                self.breakers[index].success()
                ledger = self._ledger[index]
                for seq in got:
                    ledger.pop(seq.seq_id, None)
                self.in_flight -= len(got)
                yield index, got
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return


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
