"""The generation run's report: rows, tokens, per-request latency, the engine's KV and batch figures.

The report's closing figures are gathered from a finished job's engines by `summarise` (job.py calls it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from ...config import flatten
from ...engine.engine import Engine
from ...engine.runtime.devices import combined_stats, device_summary
from ...job.accounting import accounting_line, books
from ...obs.latency import histogram_ms
from ...obs.report_json import JsonReport, ratio
from ...obs.timing import Span, write_trace


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p99/max in milliseconds of values given in seconds (nearest rank)."""
    if not values:
        return {}
    v = sorted(values)

    def rank(q: float) -> float:
        return round(v[min(len(v) - 1, int(q * len(v)))] * 1e3, 3)

    return {"p50_ms": rank(0.5), "p99_ms": rank(0.99), "max_ms": round(v[-1] * 1e3, 3)}


@dataclass(slots=True)
class GenerateReport(JsonReport):
    task: str = "generate"
    rows: int = 0
    rows_resumed: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    accounting: dict[str, Any] = field(default_factory=dict)  # rows read = written + rejected + resumed
    windows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    constrained_answers: int = 0  # answers (samples) held to a grammar: structured output
    constrained_cut: int = 0  # of which cut short of their grammar: finish_reason "length" (max_tokens, the context)
    # --speculative ngram: tokens proposed, of which the model kept (verified), and their ratio
    speculative: dict[str, Any] = field(default_factory=dict)
    # --lora: the adapters, --max-loras, and how many times an adapter was brought to a device
    lora: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    device: str = ""
    dtype: str = ""
    int8_kernel: str = ""  # --quantize int8: the kernel every engine ran (models/int8_kernels.py)
    model: str = ""
    backend: str = ""  # the models that ran: native (hpcinfer's own) or transformers
    output: str = ""
    steps: int = 0
    prefill_tokens: int = 0  # recomputation after preemption included
    decode_tokens: int = 0
    preemptions: int = 0
    oom_splits: int = 0  # steps that ran out of device memory and were split (their rows recomputed)
    prefix_cache: bool = True
    prompt_tokens_cached: int = 0  # prompt tokens served from the prefix cache (first admissions)
    prefill_tokens_saved: int = 0  # prefill tokens the cache saved, recomputations after preemption included
    kv_evictions: int = 0  # cached blocks the allocator reclaimed
    kv_blocks: int = 0
    kv_block_size: int = 0
    kv_cache_bytes: int = 0
    peak_kv_blocks: int = 0
    # what the peak would have been with every layer keeping every key: above peak_kv_blocks where
    # the sliding-window layers freed the blocks their windows had left
    peak_kv_blocks_full_attention: int = 0
    mean_occupancy: float = 0.0  # sequences in a step / --max-num-seqs, mean over steps
    ttft: dict[str, float] = field(default_factory=dict)  # admitted -> first token
    tpot: dict[str, float] = field(default_factory=dict)  # time per output token after the first
    latency_by_priority: dict[str, dict[str, float]] = field(default_factory=dict)  # read -> finished
    step_time_split: dict[str, float] = field(default_factory=dict)  # seconds: model, gather, sampling, host
    threads: dict[str, Any] = field(default_factory=dict)  # one CPU engine's threads over the run (device/threads.py)
    devices: list[dict[str, Any]] = field(default_factory=list)  # per device: rows, tokens, busy share, idle tail
    device_faults: list[dict[str, Any]] = field(default_factory=list)  # breaker transitions: device, at_s, state
    moved_prompts: dict[str, int] = field(default_factory=dict)  # per device: prompts moved away after its faults
    share_after_recovery: dict[str, float] = field(default_factory=dict)  # a recovered device's token share since
    # --tp: per rank (of each group), its weights, KV pool, resident memory after loading and time in collectives
    tensor_parallel: list[dict[str, Any]] = field(default_factory=list)
    cpu_affinity: str = ""  # --cpu-affinity: which cores each kind of thread ran on (place/affinity.py)
    config: dict[str, Any] = field(default_factory=dict)
    latency_histograms: dict[str, Any] = field(default_factory=dict)  # ttft, tpot: log-spaced bins (obs/latency.py)
    # The run over time (obs/timeline.py), the machine it ran on, and the HTML report written (if any)
    timeline: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    html_report: str = ""

    completion_tokens_per_s = property(lambda self: ratio(self.completion_tokens, self.wall_s))
    # prompt tokens served from the prefix cache / prompt tokens
    prefix_hit_rate = property(lambda self: ratio(self.prompt_tokens_cached, self.prompt_tokens))
    DERIVED = (("completion_tokens_per_s", 3), ("prefix_hit_rate", 4))

    def render(self, console: Console) -> None:
        table = Table(title="hpcinfer generate", show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        rejected = sum(self.rejects.values())
        table.add_row("rows written", f"{self.rows:,}")
        if self.rows_resumed:
            table.add_row("rows resumed", f"{self.rows_resumed:,}")
        table.add_row("rows rejected", f"{rejected:,}" + (f" {self.rejects}" if rejected else ""))
        if self.accounting:
            table.add_row("accounting", accounting_line(self.accounting) + " (balanced)")
        table.add_row("prompt / completion tokens", f"{self.prompt_tokens:,} / {self.completion_tokens:,}")
        table.add_row("finish reasons", ", ".join(f"{k} {v:,}" for k, v in sorted(self.finish_reasons.items())))
        if self.constrained_answers:
            table.add_row(
                "structured answers",
                f"{self.constrained_answers:,}, of which cut by max_tokens (finish length): {self.constrained_cut:,}",
            )
        table.add_row("wall time", f"{self.wall_s:,.2f} s")
        if self.int8_kernel:
            table.add_row("int8 kernel", self.int8_kernel)
        table.add_row("generated tokens/s", f"{self.completion_tokens_per_s:,.1f}")
        for name, p in (("TTFT", self.ttft), ("time per output token", self.tpot)):
            if p:
                table.add_row(name, f"p50 {p['p50_ms']:,.1f} ms, p99 {p['p99_ms']:,.1f} ms")
        table.add_row(
            "engine steps", f"{self.steps:,} (prefill {self.prefill_tokens:,}, decode {self.decode_tokens:,})"
        )
        kv = f"{self.peak_kv_blocks:,} / {self.kv_blocks:,} x {self.kv_block_size}"
        if self.peak_kv_blocks_full_attention > self.peak_kv_blocks:
            kv += f" (full attention on every layer: {self.peak_kv_blocks_full_attention:,})"
        table.add_row("KV blocks peak / pool", kv)
        table.add_row("preemptions", f"{self.preemptions:,}")
        if self.oom_splits:
            table.add_row("out-of-memory steps split", f"{self.oom_splits:,} (the step budget halved each time)")
        if self.prefix_cache:
            table.add_row(
                "prefix cache",
                f"hit rate {self.prefix_hit_rate:.1%}, prefill tokens saved {self.prefill_tokens_saved:,}, "
                f"evictions {self.kv_evictions:,}",
            )
        if len(self.latency_by_priority) > 1:
            for p, lat in self.latency_by_priority.items():
                table.add_row(f"latency, priority {p}", f"p50 {lat['p50_ms']:,.1f} ms, p99 {lat['p99_ms']:,.1f} ms")
        table.add_row("batch occupancy", f"{self.mean_occupancy:.0%}")
        if self.cpu_affinity:
            table.add_row("cpu affinity", self.cpu_affinity)
        self._device_rows(table)
        groups = len({r.get("group", 0) for r in self.tensor_parallel})
        for r in self.tensor_parallel:
            group = f"group {r.get('group', 0)} " if groups > 1 else ""
            table.add_row(
                f"tensor-parallel {group}rank {r['rank']} ({r['device']})",
                f"weights {r['weight_bytes'] / 2**20:,.1f} MiB, KV pool {r['kv_pool_bytes'] / 2**20:,.1f} MiB, "
                f"RSS after load {r['rss_after_load_bytes'] / 2**20:,.0f} MiB, "
                f"collectives {r['collective_s']:,.2f} s ({r['collective_calls']:,} calls)",
            )
        for t in self.device_faults:
            table.add_row(f"device {t['device']} at {t['at_s']:.1f} s", f"{t['state']}: {t['reason']}")
        if self.moved_prompts:
            table.add_row("prompts moved", ", ".join(f"from {d} {n:,}" for d, n in self.moved_prompts.items()))
        for device, share in self.share_after_recovery.items():
            table.add_row(f"device {device} after it recovered", f"{share:.0%} of the tokens generated since")
        console.print(table)

    def _device_rows(self, table: Table) -> None:
        """A row per device of a several-device run (a cluster report prints its actors instead)."""
        if len(self.devices) > 1:
            for d in self.devices:
                table.add_row(
                    f"device {d['device']}",
                    f"{d['rows']:,} rows, {d['completion_tokens']:,} tokens ({d['token_share']:.0%}), "
                    f"busy {d['busy_share']:.0%}, idle tail {d['idle_tail_s']:.2f} s",
                )


def engine_trace(
    labels: list[str], engines: list[Any], faults: list[dict[str, Any]], breaker_start: float
) -> list[Span]:
    """One span per engine step, on one track per device, and a mark where a device's breaker changed."""
    several = len(engines) > 1
    spans = [
        Span("engine_step", int(a * 1e9), int(b * 1e9), f"{label}/engine" if several else "engine",
             {"prefill_tokens": p, "decode_tokens": d})
        for label, engine in zip(labels, engines, strict=True)
        for a, b, p, d in engine.stats.step_trace
    ]  # fmt: skip
    for t in faults:
        at = int((breaker_start + t["at_s"]) * 1e9)
        spans.append(Span(f"breaker {t['state']}", at, at, f"{t['device']}/engine", {"reason": t["reason"]}))
    return sorted(spans, key=lambda span: span.start_ns)


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
    r.peak_kv_blocks_full_attention = s.peak_blocks_full_attention
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
    specs = [e.speculation for e in engines if getattr(e, "speculation", None) is not None]
    if specs:
        proposed, kept = sum(x.proposed for x in specs), sum(x.accepted for x in specs)
        r.speculative = {
            "proposed": proposed,
            "accepted": kept,
            "acceptance_rate": round(kept / proposed, 4) if proposed else 0.0,
        }
        drafts = [x.draft for x in specs if x.draft is not None]
        if drafts:  # the draft's own tokens: those it ran, those its prefix cache spared it
            r.speculative |= {"draft_tokens": sum(d.computed for d in drafts),
                              "draft_cached_tokens": sum(d.cached for d in drafts)}  # fmt: skip
    if job.config.generate.loras:
        rows = [e.runner.lora_rows for e in engines if getattr(getattr(e, "runner", None), "lora_rows", None)]
        r.lora = {
            "adapters": len(job.config.generate.loras),
            "max_loras": job.config.generate.max_loras,
            "adapter_loads": sum(x.loads for x in rows),
        }
    r.config = flatten(job.config)
    if job.config.trace_path:
        spans = engine_trace(job.labels, engines, r.device_faults, job.breaker_start)
        write_trace(spans, job.config.trace_path)
    return r
