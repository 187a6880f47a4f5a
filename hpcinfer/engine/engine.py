"""The engine loop: schedule a step, run it, sample, record; finished sequences leave that step.

plan = scheduler.schedule()          # torch-free: which tokens of which sequences
logits = runner.run(plan)            # the device: KV writes + paged attention + LM head
tokens = sampler.sample(logits, ..)  # batched, per-request generators
scheduler.update(plan, tokens)       # progress, then stop checks free blocks at once

A step ahead (on CUDA by default), the host launches step N+1 before it reads step N's tokens:
step N's sampled tokens stay on the device and feed step N+1's decodes, the sequences hold a
PENDING token meanwhile, and a sequence that ends with a token of step N has its step N+1 output
dropped. Sequences, tokens and stops are exactly those of the step-by-step loop.

Structured output (structured.py): a sequence held to a grammar needs its last token before its
next mask, so while one runs the engine goes step by step; each step's masks are filled on a host
thread while its forward runs, and applied to the logits before sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..device import accelerators
from ..device.base import is_out_of_memory
from ..device.readback import Readback, readback
from ..device.step_timer import step_timer
from ..errors import ConfigError
from ..models.llama import LlamaDecoder
from .attention.choice import attention_kind
from .beam import beam_search
from .constrained.structured import Grammars, StepMasks
from .decode_graphs import graph_peak
from .draft import DraftModel
from .engine_stats import EngineStats
from .kvcache.block_manager import blocks_for
from .kvcache.pools import KVCache, KVLayout, size_pool
from .kvcache.windowed_blocks import block_manager, longest_sequence, window_chunk
from .media import see_images
from .runner import ModelRunner
from .sample.fork import fork_samples, request_done
from .sample.logprobs import StepLogprobs, step_logprobs
from .sample.penalties import penalize
from .sample.sampling import Sampler
from .sample.stopping import stop_reason
from .scheduler import Scheduler, StepPlan
from .sequence import PENDING, SamplingParams, Sequence, Status
from .speculate import MOST_SPECULATING, Speculation, accept, accept_sampled, drop_unverified
from .staging import InFlightTokens


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | float | None = None  # bytes, a fraction of free CUDA memory, or the default
    chunked_prefill: bool = True
    prefix_cache: bool = True  # full blocks shared by key across sequences (block_manager.py)
    seed: int = 0
    timed: bool = False  # split step time into model / attention gather / sampling / host
    # Pure-decode steps in static shapes (decode_graphs.py): CUDA graphs on CUDA, the same path run
    # eagerly on CPU. NOTE: it reserves the pool's last block as the padding rows' scratch block.
    cuda_graphs: bool = False
    # One step ahead: the host plans step N+1 while the device runs step N (the tokens of step N
    # reach step N+1's inputs on the device). None: on CUDA, where the host and device overlap.
    ahead: bool | None = None
    attention: str = "auto"  # auto | torch | flash-attn | triton (attention.py, chosen once at start-up)
    kv_storage: torch.dtype | None = None  # the pools' dtype when not the model's: float8_e4m3fn (kv_cache.py)
    max_loras: int = 0  # > 0: the most LoRA adapters among the running sequences, and on the device
    speculative_tokens: int = 0  # > 0: prompt-lookup speculation, up to this many proposals a step (speculate.py)
    # Sliding-window layers free the blocks their windows have left (kvcache/windowed_blocks.py),
    # where the model has them.
    page_windows: bool = True


@dataclass(slots=True)
class _Launched:
    """A step issued to the device whose tokens the host has not read back yet."""

    plan: StepPlan
    sampling: list[Sequence]  # the sequences that sample, in plan order
    tokens: InFlightTokens | None  # their tokens, on the device
    readback: Readback | None  # the same tokens on their way to the host
    marks: list[object]  # step timer: before the forward, after it, after sampling
    gathered: float  # attention gather seconds (the CPU path)
    t0: float  # when its planning began
    host_s: float  # host seconds spent launching it
    logprobs: StepLogprobs | None = None  # the model's log-probabilities, for the rows that asked


def pool_reserve(model: LlamaDecoder, config: EngineConfig) -> Callable[[int], int] | None:
    """What the KV pool must leave free beside it: the decode graphs' peak, with --cuda-graphs."""
    if not config.cuda_graphs:
        return None
    max_blocks = blocks_for(model.cfg.max_model_len, config.block_size)
    layout = KVLayout.of(model.cfg, config.block_size, model.norm.dtype, config.kv_storage)
    gathers = attention_kind(config.attention, layout, model.norm.device) != "triton"
    return graph_peak(model.cfg, layout, config.max_num_seqs, max_blocks, gathers)


class Engine:
    """Continuous batching over a paged KV cache for one decoder on one device."""

    def __init__(
        self,
        model: LlamaDecoder,
        config: EngineConfig,
        eos_token_ids: Iterable[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        trace_steps: bool = False,
        grammars: Grammars | None = None,
        pools: Callable[[Hashable, Callable[[], KVCache]], KVCache] | None = None,
        lora_rows: Any = None,
        draft: LlamaDecoder | None = None,
        vision: Any = None,
    ) -> None:
        """`grammars`: the run's grammar engine, for requests with structured output. `pools(key,
        make)`: the KV pool kept from an earlier engine of the same key, or `make()`'s (a server's
        batches reuse one pool: its pages are already mapped, which on some machines costs more
        than a short job's forward). `lora_rows`: the LoRA adapters attached to `model`
        (models.lora.attach), told each step which rows each one answers. `draft`: with
        `speculative_tokens`, a small decoder of the same tokenizer that proposes (draft.py).
        `vision`: a vision-language model's tower (models.vlm.VisionTower), for requests with images."""
        device = model.norm.device
        self.config = config
        layout = KVLayout.of(model.cfg, config.block_size, model.norm.dtype, config.kv_storage, config.page_windows)

        def make() -> KVCache:
            return KVCache(
                layout, size_pool(layout, config.kv_cache_memory, device, pool_reserve(model, config)), device
            )

        self.cache = pools((layout, str(device), config.kv_cache_memory, config.cuda_graphs), make) if pools else make()
        self.cache.clear_written()
        num_blocks = self.cache.num_blocks
        scratch = None
        if config.cuda_graphs:
            if num_blocks < 2:
                raise ConfigError("--cuda-graphs needs a KV cache of at least 2 blocks (one is the scratch block)")
            scratch = num_blocks - 1  # never handed out: padding rows of a static decode write here
        usable = num_blocks - (scratch is not None)
        # NOTE: one sequence must always fit the whole pool, or preempting everything else would
        # still not let it grow; longer ones end with finish_reason "length".
        self.max_chunk = window_chunk(layout, config.max_num_batched_tokens)  # a sequence's prefill chunk at most
        chunk = (self.max_chunk or config.max_num_batched_tokens) if config.chunked_prefill else None
        self.max_model_len = min(model.cfg.max_model_len, longest_sequence(layout, usable, chunk))
        if self.max_model_len < config.block_size:  # NOTE: paged windows: each window group's blocks too
            raise ConfigError(
                f"--kv-cache-memory: a pool of {usable} blocks cannot hold one sequence beside its "
                f"{layout.local_groups} sliding-window tables of {layout.window} tokens; give more memory"
            )
        self._start_empty(usable, device)
        self.runner = ModelRunner(
            model,
            self.cache,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
            config.timed,
            scratch,
            config.attention,
        )
        if lora_rows is not None and config.cuda_graphs:
            raise ConfigError("--lora with --cuda-graphs: a captured decode cannot change its adapters' rows yet")
        self.runner.lora_rows = lora_rows
        self.timer = step_timer(device)
        self.readback = readback(device, config.max_num_seqs)
        self.ahead = config.ahead if config.ahead is not None else device.type == "cuda"
        self.eos = frozenset(eos_token_ids)
        self.decode = decode
        self.trace_steps = trace_steps
        self.grammars = grammars
        self.masks: StepMasks | None = None  # made for the first request with structured output
        self._vocab = model.cfg.vocab_size
        self.stats = EngineStats(num_blocks=usable)
        self.speculation = None
        if config.speculative_tokens > 0:
            drafter = None
            if draft is not None:
                drafter = DraftModel(
                    draft, config.block_size, self.max_model_len, config.max_num_batched_tokens,
                    MOST_SPECULATING, self._vocab,
                )  # fmt: skip
            self.speculation = Speculation(config.speculative_tokens, drafter)
        self.vision = vision
        # beam searches, and requests whose images the tower could not see, ended in `add`: handed on by the next step
        self._ended_in_add: list[Sequence] = []
        self._next_id = 0

    def add(
        self, tokens: list[int], params: SamplingParams, tag: Any = None, seq_id: int | None = None, priority: int = 0
    ) -> Sequence:
        """Queues a prompt; `seq_id` (else a counter) also keys an unseeded request's generator."""
        if not 0 < len(tokens) < self.max_model_len:
            raise ValueError(f"a prompt of {len(tokens)} tokens does not fit the context of {self.max_model_len}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n {params.n} samples cannot run together within max_num_seqs {self.config.max_num_seqs}")
        seq = Sequence(self._next_id if seq_id is None else seq_id, list(tokens), params, tag, priority=priority)
        if params.media is not None and (failed := see_images(self.vision, params.media, self.sampler.device)):
            seq.num_prompt, seq.status, seq.finish_reason, seq.error = len(tokens), Status.FINISHED, "error", failed
            self._next_id += 1
            self._ended_in_add.append(seq)
            return seq
        if params.beam_width > 1:  # NOTE: its beams run together now, between the batch's steps (beam.py)
            self._next_id += 1
            seq.arrival_s = time.perf_counter()
            beam_search(self, seq, self.eos)
            self._ended_in_add.append(seq)
            return seq
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("a request with structured output reached an engine without a grammar engine")
            seq.grammar = self.grammars.matcher(params.structured)
            if self.masks is None:
                self.masks = StepMasks(self._vocab, self.sampler.device)
        self._next_id += 1
        seq.arrival_s = time.perf_counter()
        self.scheduler.add(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None or bool(self._ended_in_add)

    def _start_empty(self, usable_blocks: int, device: torch.device) -> None:
        """A block manager, scheduler and sampler with nothing in them, and no step in flight."""
        c = self.config
        self.blocks = block_manager(self.cache.layout, usable_blocks, c.prefix_cache)
        self.cache.writer = self.blocks
        self.scheduler = Scheduler(
            self.blocks, c.max_num_seqs, c.max_num_batched_tokens, c.chunked_prefill, c.max_loras, self.max_chunk
        )
        self.sampler = Sampler(device, c.seed)
        self._in_flight: _Launched | None = None

    def reset(self) -> list[Sequence]:
        """Drops every sequence, as after a device fault (their K/V can no longer be trusted);
        returns them. The model and the KV pool stay; the counters carry on."""
        old, blocks = self.scheduler, self.blocks
        dropped = [*old.running, *old.waiting]
        if self.speculation is not None and self.speculation.draft is not None:
            self.speculation.draft.reset()
        self._start_empty(self.stats.num_blocks, self.sampler.device)  # NOTE: the pool's usable blocks, as at start
        self.blocks.evictions, self.blocks.peak_used = blocks.evictions, blocks.peak_used
        self.blocks.high_water = blocks.high_water
        self.blocks.peak_full_attention = blocks.peak_full_attention
        self.scheduler.preemptions, self.scheduler.cached_tokens = old.preemptions, old.cached_tokens
        return dropped

    def step(self) -> list[Sequence]:
        """One engine step; returns the sequences that finished in it.

        A step ahead (`ahead`), it launches this step and then reads the previous one's tokens
        back: the host plans and prepares step N+1 while the device runs step N. Otherwise it
        reads this step's tokens back at once.
        """
        self.cache.stepping += 1  # NOTE: a pool kept for a later run is not handed out while a step is in it
        try:
            done, self._ended_in_add = self._ended_in_add, []
            return done + self._step() if self.scheduler.has_work or self._in_flight is not None else done
        finally:
            self.cache.stepping -= 1

    def _step(self) -> list[Sequence]:
        finished: list[Sequence] = []
        spec = self.speculation
        proposing = spec is not None and spec.may_propose(self.scheduler)
        # NOTE: a grammar's next mask, and proposals, need the token in flight: step by step then
        ahead = self.ahead and not self._constrained() and not proposing
        if not ahead and self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            finished = self._resolve(previous)
        t0 = time.perf_counter()
        drafted = spec.propose(self.scheduler, self.config.block_size, self.max_model_len) if proposing else []
        plan = self.scheduler.schedule()
        if drafted:
            drop_unverified(plan, drafted)
        launched = None
        if plan.chunks:
            try:
                launched = self._launch(plan, t0)
            except Exception as exc:
                if not is_out_of_memory(exc) or not self._shrink_after_oom(plan):
                    raise
                return finished  # NOTE: the step's work is back in the queue; nothing of it ran
        elif self._in_flight is None:
            if finished or not self.scheduler.has_work:
                return finished
            raise RuntimeError("the scheduler planned an empty step with work queued")
        if not ahead:
            assert launched is not None
            return finished + self._resolve(launched)
        previous, self._in_flight = self._in_flight, launched
        return self._resolve(previous) if previous is not None else []

    def _constrained(self) -> bool:
        """Whether a sequence held to a grammar is queued or running."""
        s = self.scheduler
        return self.masks is not None and any(q.grammar is not None for q in (*s.running, *s.waiting))

    def _shrink_after_oom(self, plan: StepPlan) -> bool:
        """The step ran out of device memory: an out-of-memory is the batch's size, not the
        device's fault. Its newest half of sequences goes back to the queue (recomputed later,
        their answers unchanged), and the step's token budget and its sequences halve, for the
        rest of the run; False when there is nothing left to split (one sequence at the smallest
        budget), and the error stands.
        """
        seqs = list(dict.fromkeys(c.seq for c in plan.chunks))
        budget = self.scheduler.max_num_batched_tokens
        if len(seqs) == 1 and budget <= self.config.block_size:
            return False
        self.blocks.abort(seqs)
        accelerators.release_cached(self.sampler.device)  # NOTE: the failed step's blocks of the caching allocator
        newest = sorted(seqs, key=self.scheduler.running.index)[len(seqs) // 2 :] if len(seqs) > 1 else []
        for seq in reversed(newest):
            self.scheduler.preempt(seq)
        self.scheduler.max_num_batched_tokens = max(self.config.block_size, budget // 2)
        self.scheduler.max_num_seqs = max(1, min(self.scheduler.max_num_seqs, len(seqs) - len(newest)))
        self.stats.oom_splits += 1
        return True

    def _launch(self, plan: StepPlan, t0: float) -> _Launched:
        """Issues the step (forward, sampling, the tokens' copy back) and records it as PENDING tokens."""
        gather0 = self.runner.attention.gather_s
        t1 = time.perf_counter()
        marks = [self.timer.mark()]
        ahead = self._in_flight.tokens if self._in_flight is not None else None
        sampling = [c.seq for c in plan.chunks if c.samples]
        masks = [self.masks.start(sampling)] if self.masks is not None else []  # filled beside the forward
        logits = self.runner.run(plan, ahead)
        own = len(sampling)
        rows = fork_samples(sampling, self.scheduler, self.cache, self.grammars)  # n samples: see samples.py
        if rows is not None:
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            if self.masks is not None:
                masks.append(self.masks.start(sampling[own:], own))
        marks.append(self.timer.mark())
        raw = logits  # NOTE: logprobs are the model's own, before penalties and temperature (as vLLM's)
        if sampling:
            logits = penalize(logits, sampling, self.eos, ahead)  # NOTE: before greedy or sampled choice
        for pending in masks:
            if pending is not None:
                logits = pending.apply(logits)
        tokens = self.sampler.sample_on_device(logits, sampling) if sampling else None
        logprobs = step_logprobs(raw, sampling, tokens) if tokens is not None else None
        marks.append(self.timer.mark())
        readback = self.readback.start(tokens) if tokens is not None else None
        self.scheduler.advance(plan)
        for child in sampling[own:]:
            child.tokens.append(PENDING)  # NOTE: as `advance` records its parent's token
        for seq in sampling:  # NOTE: known now, whatever the token: nothing more to schedule for it
            seq.draining = seq.num_completion >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        in_flight = InFlightTokens(tokens, sampling) if tokens is not None else None
        gathered = self.runner.attention.gather_s - gather0
        host_s = time.perf_counter() - t1
        return _Launched(plan, sampling, in_flight, readback, marks, gathered, t0, host_s, logprobs)

    def _resolve(self, step: _Launched) -> list[Sequence]:
        """Reads a launched step's tokens back, fills them in, checks stops; returns who finished."""
        stats, t3 = self.stats, time.perf_counter()
        values = step.readback.values() if step.readback is not None else []
        now = time.perf_counter()
        finished = []
        asked = step.logprobs.on_host() if step.logprobs is not None else {}
        for row, (seq, token) in enumerate(zip(step.sampling, values, strict=True)):
            if seq.status is Status.FINISHED:
                continue  # it ended with a token of the step before; this one's token is void
            if row in asked:
                seq.logprobs.append(asked[row])
            if seq.draft:  # NOTE: never a step ahead: the PENDING token is the last
                if self._speculated(seq, now) and (done := request_done(seq)) is not None:
                    finished.append(done)
                continue
            # the first PENDING token: the last, or the one before it when the next step's is pending too
            at = len(seq.tokens) - (2 if len(seq.tokens) > 1 and seq.tokens[-2] == PENDING else 1)
            seq.tokens[at] = token
            if self._check_stop(seq, at, now) and (done := request_done(seq)) is not None:
                finished.append(done)
        t4 = time.perf_counter()
        plan = step.plan
        model_s = self.timer.seconds(step.marks[0], step.marks[1]) - step.gathered
        stats.record(plan, self.scheduler, self.blocks, self.config.max_num_seqs)
        stats.add_times(
            step.host_s + (t4 - t3), model_s, step.gathered, self.timer.seconds(step.marks[1], step.marks[2])
        )
        if self.trace_steps:
            stats.step_trace.append((step.t0, t4, plan.prefill_tokens, len(plan.decodes)))
        return finished

    def _speculated(self, seq: Sequence, now: float) -> bool:
        """A verified sequence: its kept proposals and the model's next token, each checked for a
        stop in order (as one token a step would have been); True when it ended."""
        assert self.speculation is not None
        real, proposed = len(seq.tokens) - 1 - seq.draft, seq.draft
        greedy = seq.params.greedy
        kept = accept(seq, real) if greedy else accept_sampled(seq, real, self.sampler.generator_of(seq))
        self.speculation.record(proposed, kept)
        seq.draining = seq.num_completion >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        return any(self._check_stop(seq, at, now) for at in range(real, len(seq.tokens)))

    def _check_stop(self, seq: Sequence, at: int, now: float) -> bool:
        """Whether the token at `at` (just read back) ends `seq`; if so it ends there.

        NOTE: a step ahead, a later PENDING token may follow it: an ending drops it."""
        if seq.first_token_s is None:
            seq.first_token_s = now
        reason = stop_reason(seq, at, self.eos, self.decode, self.max_model_len)
        if reason is None:
            return False
        del seq.tokens[at + 1 :]
        seq.finish_s = now
        self.stats.finished(seq.grammar is not None, reason)
        self.scheduler.finish(seq, reason)
        self.sampler.release(seq)
        return True

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Runs prompts to completion; returns their sequences in prompt order (tests, benchmarks)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, each, strict=True)]
        while self.has_work:
            self.step()
        return seqs
