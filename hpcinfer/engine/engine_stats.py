"""What an engine counts as it steps: tokens, preemptions, the prefix cache, blocks, occupancy,
and where each step's time went (engine.py records; the report and the devices' summary read)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kvcache.block_manager import BlockManager
from .scheduler import Scheduler, StepPlan


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    continued_chunks: int = 0  # prefill chunks that start mid-prompt (chunked prefill at work)
    preemptions: int = 0
    cached_tokens: int = 0  # prefill tokens the prefix cache saved (recomputations included)
    evictions: int = 0  # cached blocks reclaimed by the allocator
    peak_blocks: int = 0
    # the blocks the same sequences would have held with every layer keeping every key (equal to
    # peak_blocks but with paged windows: kvcache/windowed_blocks.py)
    peak_blocks_full_attention: int = 0
    num_blocks: int = 0
    occupancy_sum: float = 0.0  # per step: running sequences / max_num_seqs
    last_occupancy: float = 0.0  # the latest step's (the metrics endpoint's gauge)
    oom_splits: int = 0  # steps that ran out of device memory and were split (engine._shrink_after_oom)
    constrained: int = 0  # answers held to a grammar (structured output), samples counted one by one
    constrained_cut: int = 0  # of which ended incomplete, finish_reason "length" (max_tokens, the context)
    host_s: float = 0.0  # scheduling, input preparation, stop checks
    # Device time (timed events on CUDA: device/step_timer.py): the forward pass minus the
    # attention gathers (timed on the CPU path only), and sampling.
    model_s: float = 0.0
    gather_s: float = 0.0
    sample_s: float = 0.0
    step_trace: list[tuple[float, float, int, int]] = field(default_factory=list)  # (start, end, prefill, decode)

    @property
    def mean_occupancy(self) -> float:
        return self.occupancy_sum / self.steps if self.steps else 0.0

    def record(self, plan: StepPlan, scheduler: Scheduler, blocks: BlockManager, max_num_seqs: int) -> None:
        """One step's tokens, and the scheduler's and block manager's running counters after it."""
        self.steps += 1
        self.prefill_tokens += plan.prefill_tokens
        self.decode_tokens += len(plan.decodes)
        self.continued_chunks += sum(c.start > 0 for c in plan.prefills)
        self.preemptions = scheduler.preemptions
        self.cached_tokens = scheduler.cached_tokens
        self.evictions = blocks.evictions
        self.peak_blocks = blocks.peak_used
        self.peak_blocks_full_attention = blocks.peak_full_attention
        self.last_occupancy = len(plan.chunks) / max_num_seqs
        self.occupancy_sum += self.last_occupancy

    def finished(self, constrained: bool, reason: str) -> None:
        """A sequence (one sample) that ended with finish `reason`; `constrained`: held to a grammar."""
        if constrained:
            self.constrained += 1
            self.constrained_cut += reason == "length"

    def add_times(self, host_s: float, model_s: float, gather_s: float, sample_s: float) -> None:
        self.host_s += host_s
        self.model_s += model_s
        self.gather_s += gather_s
        self.sample_s += sample_s


__all__ = ["EngineStats"]
