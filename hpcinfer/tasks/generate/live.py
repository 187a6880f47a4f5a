"""What a generation run shows while it runs (obs/meter.py): tokens, the engines' queues, batch
occupancy, the KV pool, preemptions, the prefix cache and where each step's time goes, read from
the engines' and the tally's own counters (the same ones the report ends with)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...obs.meter import COUNTER, GAUGE, Meter
from .tally import SequenceTally

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
    for stage, field in STEP_TIMES:
        meter.probe(f"step_busy_s.{stage}", total(lambda e, f=field: getattr(e.stats, f)), COUNTER)
    if all(hasattr(e, "scheduler") for e in engines):
        meter.probe("running", total(lambda e: len(e.scheduler.running)))
        meter.probe("waiting", total(lambda e: len(e.scheduler.waiting)))
        meter.probe("kv_blocks_used", total(lambda e: e.blocks.num_used))
        meter.probe("kv_blocks_total", total(lambda e: e.stats.num_blocks))
