"""The generation report's closing figures, from a finished job's engines (job.py)."""

from __future__ import annotations

import time
from typing import Any

from ...config import flatten
from ...engine.engine import Engine
from ...engine.runtime.devices import combined_stats, device_summary
from ...job.accounting import books
from ...obs.histogram import histogram_ms
from ...obs.trace import write_trace
from .report import GenerateReport, engine_trace, percentiles


def summarise(job: Any, engines: list[Engine], start: float, resumed: int) -> GenerateReport:
    """Fills `job.report` (job: a GenerationJob) from its engines' counters and its own; writes the
    trace (--trace) when asked (api.run writes the report)."""
    r, s = job.report, combined_stats([e.stats for e in engines])
    end = time.perf_counter()
    r.wall_s = end - start
    r.rows = job.store.rows_written
    r.rows_resumed = resumed
    books(r)
    r.windows = len(job.store.windows)
    r.rejects = dict(sorted(job.rejects.by_reason.items()))
    r.output = job.config.output.path
    r.steps, r.prefill_tokens, r.decode_tokens = s.steps, s.prefill_tokens, s.decode_tokens
    r.preemptions, r.peak_kv_blocks, r.kv_blocks = s.preemptions, s.peak_blocks, s.num_blocks
    r.oom_splits = s.oom_splits
    r.constrained_answers, r.constrained_cut = s.constrained, s.constrained_cut
    r.kv_block_size, r.kv_cache_bytes = job.engine_config.block_size, sum(e.cache.nbytes for e in engines)
    r.mean_occupancy = round(s.mean_occupancy, 4)
    r.prefix_cache, r.prefill_tokens_saved, r.kv_evictions = (
        job.engine_config.prefix_cache,
        s.cached_tokens,
        s.evictions,
    )
    t = job.tally
    r.prompt_tokens, r.completion_tokens, r.prompt_tokens_cached = t.prompt_tokens, t.completion_tokens, t.cached_tokens
    r.finish_reasons = dict(t.finish_reasons)
    r.latency_by_priority = {str(p): percentiles(v) for p, v in sorted(t.latency.items(), reverse=True)}
    r.ttft, r.tpot = percentiles(t.ttft), percentiles(t.tpot)
    r.latency_histograms = {"ttft": histogram_ms(t.ttft), "tpot": histogram_ms(t.tpot)}
    r.step_time_split = {
        k: round(v, 4)
        for k, v in (
            ("model", s.model_s),
            ("attention_gather", s.gather_s),
            ("sampling", s.sample_s),
            ("host", s.host_s),
        )
    }
    r.devices = device_summary(job.labels, engines, job.by_device, start, end)
    r.config = flatten(job.config)
    if job.config.trace_path:
        spans = engine_trace(job.labels, engines, r.device_faults, job.breaker_start)
        write_trace(spans, job.config.trace_path)
    return r
