"""Generation on several devices of one machine: one engine per device, each driven by its own thread
(`EngineWorker`, here), fed and drained by one `EnginePool` (pool.py).

    admission -> EnginePool.add -> the device that would finish it soonest -> worker: engine.add
                                                                              worker: engine.step
    job loop  <- EnginePool.finished <- one outbox of (device index, finished sequences) <-'

Each worker owns its engine (model copy, KV pool, scheduler, sampler); only its thread touches
it. A prompt goes to the engine with the fewest outstanding tokens: prompt tokens still to
compute plus tokens still to generate (`max_tokens` left) of its queued and running sequences,
divided by the tokens per second that engine has measured (dispatch.py's rule). Finished work
leaves the count, so a slow device is given less. With prefix caching, the engine that was last
given a prompt's longest known prefix counts that prefix as work it will not do: prompts that
share a prefix (admission sends them one after the other) stay together unless the balance
says otherwise. `round_robin` deals prompts in turn, by rows,
for comparison. Every request's seed derives from its input row (or its own `seed`), so the
answers do not depend on which device ran them. Torch releases the GIL in its ops, so the
threads overlap; CPU engines split the machine's threads between them.

A device that fails is not the end of the run (place/breaker.py): its engine drops its
sequences (their K/V is lost) and the pool sends them, by their prompts and seeds, to the others
(so the answers do not change); its breaker, once open, keeps work away until a cool-down has
passed. A step that runs past `step_timeout` counts as a hang: the device is opened at once, its
work moved, and whatever that step returns later is dropped. The run fails only when every
device is open.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from ...device import accelerators
from ...device.threads import set_torch_threads
from ...errors import HpcinferError
from ...obs.profile import RangeBackend
from ...place.affinity import pin_thread
from ...place.breaker import DeviceFault, fault_text
from ..engine import Engine
from ..engine_stats import EngineStats
from ..sequence import SamplingParams, Sequence
from .loop import engine_step


@dataclass(slots=True)
class Prompt:
    tokens: list[int]
    params: SamplingParams
    tag: Any
    seq_id: int | None
    priority: int

    @property
    def charge(self) -> int:
        return len(self.tokens) + self.params.max_tokens


def tokens_left(seq: Sequence) -> int:
    """Tokens `seq` still puts through the model: the rest of its prompt (or recomputation) and of its answer."""
    return (seq.num_tokens - seq.num_computed) + max(seq.params.max_tokens - seq.num_completion, 0)


def step_fault(engine: Engine, exc: Exception, device: int = 0) -> DeviceFault:
    """What an engine step raised, as its device's fault: the one rule of every engine, local or a
    Ray replica. A user's problem (HpcinferError: a bad option, a file that changed) is re-raised, to
    end the run as one line; a row's own problem never raises (it is a reject); anything else is
    the device's. The engine drops its sequences (their K/V can no longer be trusted): the caller
    runs their prompts elsewhere, with their seeds."""
    if isinstance(exc, HpcinferError):
        raise exc
    return DeviceFault(device, fault_text(exc), dropped=tuple(seq.seq_id for seq in engine.reset()))


@dataclass(slots=True)
class WorkerStats:
    """One device's figures, written by its thread only (dispatch reads the rate as it goes)."""

    steps: int = 0
    busy_s: float = 0.0  # inside engine.step()
    computed_tokens: int = 0  # prefill + decode tokens through the model
    last_step_end: float = 0.0  # perf_counter seconds


class EngineWorker:
    """One device's engine and the thread that drives it: prompts in through `submit`, finished out on `outbox`."""

    def __init__(
        self,
        index: int,
        label: str,
        engine: Engine,
        outbox: queue.Queue[tuple[int, list[Sequence] | DeviceFault | BaseException]],
        threads: int | None = None,
        hook: Callable[[], None] | None = None,
        ranges: RangeBackend | None = None,
        cores: tuple[int, ...] | None = None,
    ) -> None:
        self.index, self.label, self.engine, self.outbox = index, label, engine, outbox
        self.cores = cores  # --cpu-affinity: this engine's thread and torch's threads under it
        self.threads, self.hook, self.ranges = threads, hook, ranges
        self.stats = WorkerStats()
        self.sent = 0  # prompts given to this device
        self._cond = threading.Condition()
        self._inbox: list[Prompt] = []
        self._inbox_charge = 0
        self._engine_left = 0  # tokens_left summed over the engine's sequences, after its last step
        self._waiting = 0  # the engine's queue after its last step
        self._closing = False
        self.epoch = 0  # bumped when the pool gives up on a hung step: what that step returns is dropped
        self.step_started: float | None = None  # perf_counter seconds, while a step runs
        self._thread = threading.Thread(target=self._run, name=f"engine@{label}", daemon=True)

    # --- the job's side -------------------------------------------------------------------------

    def submit(self, prompt: Prompt) -> None:
        with self._cond:
            self._inbox.append(prompt)
            self._inbox_charge += prompt.charge
            self.sent += 1
            self._cond.notify()

    @property
    def outstanding(self) -> int:
        with self._cond:
            return self._engine_left + self._inbox_charge

    @property
    def queued(self) -> int:
        """Prompts sent here and not yet admitted into a batch."""
        with self._cond:
            return len(self._inbox) + self._waiting

    @property
    def rate(self) -> float:
        """Tokens per second of step time; 0 until a step has run."""
        s = self.stats
        return s.computed_tokens / s.busy_s if s.busy_s > 0 else 0.0

    def withdraw(self) -> list[Prompt]:
        """Takes back the prompts sent here and not yet in the engine."""
        with self._cond:
            prompts, self._inbox, self._inbox_charge = self._inbox, [], 0
            return prompts

    def abandon(self) -> None:
        """Gives up on the step that runs now (hung): it, and its engine's sequences, no longer count."""
        with self._cond:
            self.epoch += 1
            self._engine_left = self._waiting = 0

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 60.0) -> None:
        """Stops the thread after its current step (queued prompts are dropped) and waits for it
        (not for a step given up on as hung)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            hung = self.step_started is not None and self.epoch > 0
        if self._thread.is_alive():
            self._thread.join(0.0 if hung else timeout)

    # --- the worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.cores is not None:
                pin_thread(self.cores)  # NOTE: before torch's first parallel region, so its threads inherit
            if self.engine.cache.device.type == "cuda":
                accelerators.make_current(self.engine.cache.device)
            elif self.threads:  # NOTE: the intra-op thread count is per calling thread: each engine keeps its share
                set_torch_threads(self.threads)
            with torch.inference_mode():  # NOTE: thread-local; the job's own does not reach this thread
                while self._take():
                    try:
                        self._step()
                    except Exception as exc:  # a device fault: the pool moves the work, the thread goes on
                        self.step_started = None
                        fault = step_fault(self.engine, exc, self.index)
                        with self._cond:
                            self._engine_left = self._waiting = 0
                        self.outbox.put((self.index, fault))
        except BaseException as exc:  # sent to the job loop, which stops the run naming this device
            self.outbox.put((self.index, exc))

    def _take(self) -> bool:
        """Moves submitted prompts into the engine; waits while there is nothing to run; False when closed."""
        with self._cond:
            while not self._closing and not self._inbox and not self.engine.has_work:
                self._cond.wait()
            if self._closing:
                return False
            for p in self._inbox:
                self.engine.add(p.tokens, p.params, tag=p.tag, seq_id=p.seq_id, priority=p.priority)
            self._engine_left += self._inbox_charge
            self._waiting += len(self._inbox)
            self._inbox, self._inbox_charge = [], 0
            return True

    def _step(self) -> None:
        engine, stats = self.engine, self.stats
        prefill, decode = engine.stats.prefill_tokens, engine.stats.decode_tokens
        t0 = time.perf_counter()
        epoch, self.step_started = self.epoch, t0
        finished = engine_step(engine, self.label, self.hook, self.ranges)  # NOTE: the hook inside the measured time
        self.step_started = None
        if epoch != self.epoch:  # given up on as hung: its sequences went elsewhere
            engine.reset()
            return
        t1 = time.perf_counter()
        prefill, decode = engine.stats.prefill_tokens - prefill, engine.stats.decode_tokens - decode
        stats.steps += 1
        stats.busy_s += t1 - t0
        stats.computed_tokens += prefill + decode
        stats.last_step_end = t1
        s = engine.scheduler
        left = sum(tokens_left(q) for q in chain(s.running, s.waiting))
        with self._cond:
            admitted = len(s.waiting) < self._waiting
            self._engine_left, self._waiting = left, len(s.waiting)
        if finished or admitted:  # NOTE: room in this engine's queue wakes the job loop to feed it
            self.outbox.put((self.index, finished))


def combined_stats(each: list[EngineStats]) -> EngineStats:
    """The engines' figures as one: counts and times summed, occupancy the mean over all their steps."""
    if len(each) == 1:
        return each[0]
    total = EngineStats()
    for name in EngineStats.__slots__:
        if name != "step_trace":
            setattr(total, name, sum(getattr(s, name) for s in each))
    return total


def device_summary(
    labels: list[str], engines: list[Engine], counts: list[Any], start: float, end: float
) -> list[dict[str, Any]]:
    """Per device: rows and tokens it answered, its busy share and its idle tail.

    `counts[i]` has the rows, prompt_tokens, completion_tokens and last_step_end of device i. The
    idle tail is the time from the device's last step to the last step of any device: the
    imbalance a better dispatch would have removed.
    """
    wall = max(end - start, 1e-9)
    completion = sum(c.completion_tokens for c in counts) or 1
    last = max((c.last_step_end for c in counts), default=start)
    rows = []
    for label, engine, c in zip(labels, engines, counts, strict=True):
        s = engine.stats
        busy = s.host_s + s.model_s + s.gather_s + s.sample_s
        finished = max(c.last_step_end, start)
        rows.append(
            {
                "device": label,
                "rows": c.rows,
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
                "token_share": round(c.completion_tokens / completion, 4),
                "steps": s.steps,
                "prefill_tokens": s.prefill_tokens,
                "decode_tokens": s.decode_tokens,
                "preemptions": s.preemptions,
                "peak_kv_blocks": s.peak_blocks,
                "busy_s": round(busy, 4),
                "busy_share": round(busy / wall, 4),
                "finished_s": round(finished - start, 4),
                "idle_tail_s": round(max(last, start) - finished, 4),
            }
        )
    return rows
