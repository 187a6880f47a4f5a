"""What finished sequences add up to, wherever they finish: the local job, a Ray replica's unit, a
tuning pass. One rule for every count (rows, prompt, cached and generated tokens, finish reasons)
and every latency (time to first token, time per output token, read to finished per priority).

What a generation run shows while it runs (`watch_engines`, obs/meter.py) is read from the same
counters: the tally's tokens, the engines' queues, batch occupancy, the KV pool, preemptions, the
prefix cache and where each step's time goes (the figures the report ends with).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...engine.sequence import Sequence
from ...obs.meter import COUNTER, GAUGE, Meter


@dataclass(slots=True)
class SequenceTally:
    rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0  # every sample's (n > 1: all n answers)
    cached_tokens: int = 0  # prompt tokens the prefix cache held
    finish_reasons: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)  # seconds: admitted -> first token
    tpot: list[float] = field(default_factory=list)  # seconds per output token after the first
    latency: dict[int, list[float]] = field(default_factory=dict)  # per priority: read (or arrived) -> finished

    def add(self, seq: Sequence, read_s: float | None = None) -> None:
        """A finished sequence; `read_s` (perf_counter seconds): when its row was read, for its latency."""
        self.rows += 1
        self.prompt_tokens += seq.num_prompt
        self.completion_tokens += seq.answer_tokens
        self.cached_tokens += seq.num_cached
        for sample in seq.all_samples:
            self.finish_reasons[sample.finish_reason] = self.finish_reasons.get(sample.finish_reason, 0) + 1
        self.ttft.append(seq.first_token_s - seq.arrival_s)
        if seq.num_completion > 1:
            self.tpot.append((seq.finish_s - seq.first_token_s) / (seq.num_completion - 1))
        if read_s is not None:
            self.latency.setdefault(seq.priority, []).append(seq.done_s - read_s)

    def figures(self) -> dict[str, Any]:
        """The counts under the names a report and a Ray unit's figures give them."""
        return {
            "rows": self.rows,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_cached": self.cached_tokens,
            "finish_reasons": dict(self.finish_reasons),
        }


STEP_TIMES = (("model", "model_s"), ("attention_gather", "gather_s"), ("sampling", "sample_s"), ("host", "host_s"))


def watch_engines(meter: Meter, engines: list[Any], tally: SequenceTally) -> None:
    """Registers the generation figures; an engine without a scheduler (--backend transformers)
    shows its tokens and step counts only."""

    def total(read: Callable[[Any], float]) -> Callable[[], float]:
        return lambda: sum(read(e) for e in engines)

    for name, read, kind in (
        ("tokens.prompt", lambda: tally.prompt_tokens, COUNTER),
        ("tokens.completion", lambda: tally.completion_tokens, COUNTER),
        ("prefix_cache_hit_tokens", lambda: tally.cached_tokens, COUNTER),
        ("steps", total(lambda e: e.stats.steps), COUNTER),
        # NOTE: as the engines step (the tokens above count as sequences finish): the chart's rates
        ("step_tokens.prefill", total(lambda e: e.stats.prefill_tokens), COUNTER),
        ("step_tokens.decode", total(lambda e: e.stats.decode_tokens), COUNTER),
        ("occupancy_sum", total(lambda e: e.stats.occupancy_sum), COUNTER),
        ("preemptions", total(lambda e: e.stats.preemptions), COUNTER),
        ("batch_occupancy", lambda: sum(e.stats.last_occupancy for e in engines) / len(engines), GAUGE),
    ):
        meter.probe(name, read, kind)
    for stage, stat in STEP_TIMES:
        meter.probe(f"step_busy_s.{stage}", total(lambda e, f=stat: getattr(e.stats, f)), COUNTER)
    if all(hasattr(e, "scheduler") for e in engines):
        meter.probe("running", total(lambda e: len(e.scheduler.running)))
        meter.probe("waiting", total(lambda e: len(e.scheduler.waiting)))
        meter.probe("kv_blocks_used", total(lambda e: e.blocks.num_used))
        meter.probe("kv_blocks_total", total(lambda e: e.stats.num_blocks))
