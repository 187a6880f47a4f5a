"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

Torch-free and table-tested. One `schedule()` is a pure function of the waiting queue, the
running list and the free blocks:
1. running sequences in the decode phase take one token each (oldest first);
2. running sequences still mid-prompt (chunked prefill) take the next chunk of their prompt;
3. waiting prompts are admitted, highest priority first and oldest first within a priority, into
   the token budget that is left, a long one as a chunk (so decodes never stall behind it) while
   `--max-num-seqs` allows. With prefix caching a prompt starts after its cached prefix (those
   tokens cost no budget), and one whose next block another sequence writes in this very step
   waits a step for it rather than computing it twice.
With `max_loras`, the running sequences use at most that many LoRA adapters (the base is none): a
prompt of another adapter is passed over while the set is full, so prompts of the adapters already
running go ahead of it; once passed over in LORA_PATIENCE steps, nothing is admitted behind it until
an adapter's sequences have all ended and it fits.
When a running sequence needs a block and none is free, the most recently admitted sequence is
preempted: its blocks are freed and it goes back to the front of its priority's queue.

When the engine runs a step ahead (`advance`, then the tokens arrive a step later), a sequence
whose last token is still on its way decodes it from the device; one that ends by length with
that token (`draining`) is not scheduled again, nor preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .kvcache.block_manager import BlockManager
from .sequence import PENDING, Sequence, Status

LORA_PATIENCE = 32  # steps a prompt is passed over for its adapter before the queue stops behind it


@dataclass(frozen=True, slots=True)
class Chunk:
    """`length` tokens of `seq`, starting at token `start`, go through the model this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token: its logits give the next one."""
        return self.start + self.length == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    decodes: list[Chunk] = field(default_factory=list)  # one token each, contexts in the cache
    prefills: list[Chunk] = field(default_factory=list)  # prompt chunks (of new or recomputed sequences)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[Chunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.length for c in self.prefills)


class WaitQueue:
    """Waiting sequences: highest priority first, first come first served within a priority."""

    def __init__(self) -> None:
        self._queues: dict[int, deque[Sequence]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        for priority in sorted(self._queues, reverse=True):
            yield from self._queues[priority]

    def __getitem__(self, i: int) -> Sequence:
        return next(s for j, s in enumerate(self) if j == i)

    def append(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.priority, deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.priority, deque()).appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[seq.priority]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.priority]
        self._len -= 1


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        max_loras: int = 0,
        max_chunk: int | None = None,
    ) -> None:
        """`max_loras`: the most LoRA adapters among the running sequences (0: no bound).
        `max_chunk`: with chunked prefill, the most prompt tokens one sequence computes in a step
        (paged windows: each window group holds a chunk's blocks, so a bound keeps the longest
        context a pool holds from shrinking as the step budget grows)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.max_loras = max_loras
        self.max_chunk = max_chunk if chunked_prefill and max_chunk else max_num_batched_tokens
        self.waiting = WaitQueue()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.preemptions = 0
        self.cached_tokens = 0  # tokens taken from the prefix cache instead of computed, all admissions

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        for decode_phase in (True, False):
            for seq in [s for s in self.running if s.is_decode == decode_phase]:
                if budget == 0:
                    break
                if seq.status is not Status.RUNNING or seq.draining:  # preempted earlier in this step, or done
                    continue
                n = 1 if decode_phase else min(seq.remaining, budget, self.max_chunk)
                if not self._make_room(seq, n, plan):
                    continue
                self.blocks.grow(seq, n)
                (plan.decodes if decode_phase else plan.prefills).append(Chunk(seq, seq.num_computed, n))
                budget -= n
        self._admit(plan, budget)
        return plan

    def _make_room(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Preempts the newest running sequences until `seq` can grow by n; False if `seq` itself went.

        NOTE: a sequence already given a chunk in this step is never a victim (its blocks are in
        the plan); `seq` itself is unscheduled, so a victim always exists.
        """
        while not self.blocks.can_grow(seq, n):
            scheduled = {id(c.seq) for c in plan.chunks}
            victim = next(s for s in reversed(self.running) if id(s) not in scheduled and not s.draining)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Sends a running sequence back to the queue (the engine, after a step it could not run)."""
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)  # recomputed first: it was admitted before anything still waiting

    def _admit(self, plan: StepPlan, budget: int) -> None:
        # NOTE: a sequence preempted in this step is not re-admitted in the same step.
        preempted = {id(s) for s in plan.preempted}
        # NOTE: a prompt with n samples takes n places: its forks join the running list when it
        # samples, so places are held for the forks of prompts still prefilling too
        places = len(self.running) + sum(s.forks_due for s in self.running)
        adapters = {s.params.lora for s in self.running} - {0}
        for seq in list(self.waiting):
            if budget == 0 or places + 1 + seq.forks_due > self.max_num_seqs or id(seq) in preempted:
                break
            lora = seq.params.lora
            if self.max_loras and lora and lora not in adapters and len(adapters) >= self.max_loras:
                seq.lora_waits += 1
                if seq.lora_waits > LORA_PATIENCE:
                    break  # NOTE: the running adapters drain, so this one gets its turn
                continue
            hits, pending = self.blocks.match(seq)
            if pending:
                continue
            cached = len(hits) * self.blocks.block_size
            todo = seq.num_tokens - cached
            n = min(todo, budget, self.max_chunk)
            if (n < todo and not self.chunked_prefill) or not self.blocks.can_admit(hits, seq, n):
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            places += 1 + seq.forks_due
            adapters |= {lora} - {0}
            seq.lora_waits = 0
            self.blocks.admit(seq, hits, n)
            if seq.preemptions == 0:
                seq.num_cached = cached
            self.cached_tokens += cached
            plan.prefills.append(Chunk(seq, cached, n))
            budget -= n

    def update(self, plan: StepPlan, sampled: Iterable[int]) -> list[Sequence]:
        """Records the step: computed tokens advance and each sampling chunk's token is appended.

        `sampled` has one token per chunk with `samples`, in `plan.chunks` order. Returns the
        sequences that received a token (the caller decides which of them finished).
        """
        tokens = iter(sampled)
        grown = self.advance(plan)
        for seq in grown:
            seq.tokens[-1] = next(tokens)
        return grown

    def advance(self, plan: StepPlan) -> list[Sequence]:
        """Records a step whose tokens are not known yet: computed tokens advance and each sampling
        chunk's sequence gets a PENDING token, filled in when the step's tokens arrive. Returns
        those sequences, in `plan.chunks` order."""
        grown = []
        for chunk in plan.chunks:
            chunk.seq.num_computed += chunk.length
            if chunk.samples:
                chunk.seq.tokens.append(PENDING)
                grown.append(chunk.seq)
        self.blocks.commit()
        return grown

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends `seq` now: its blocks are free for the next step's admissions.

        NOTE: a sequence preempted while its last token was on its way may end from the queue.
        """
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
