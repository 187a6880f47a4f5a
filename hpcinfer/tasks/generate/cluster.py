"""Generation on a Ray cluster: what the cluster driver (ray_engine/driver.py) needs of this task.

Each actor loads the decoder once and runs generation's own engine over each window it gets
(replica.py). The driver commits each window's answers, less requests whose id an earlier window
had, and merges the actors' figures: tokens, steps and engine seconds add up; the KV pool is one
actor's (every actor sizes its own the same way), its peak the highest; TTFT, time per output
token and latency are percentiles over every answer of every unit; each actor gets a row of the
per-actor table, and `cluster` names the slowest (fewest generated tokens per busy second).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ...config import RunConfig
from ...errors import ConfigError
from ...files.ids import IdSet
from ...files.parts import PartStore
from ...files.sources import Source
from ...job.accounting import AccountingError
from ...job.claim import recorded_fingerprint
from ...models.decoder_checkpoint import load_tokenizer
from ...models.decoder_inspect import DecoderInfo
from ...models.decoder_int8 import INT8_ROWS
from ...models.int8_kernels import resumed_int8, settled_int8
from ...obs.render import cluster_line, rows_table
from ...ray_engine.cluster import Pool
from ...ray_engine.commit import Admitted, repeated_rows, with_duplicate_rejects
from ...ray_engine.merge import cluster_figures, per_actor
from ...ray_engine.units import Unit
from .answers import GenerationStore, answers_table, with_errors
from .replica import GenerateUnitResult
from .report import GenerateReport, percentiles
from .requests import RequestReader
from .setup import generation_fingerprint, media_windows, request_reader, run_decoder_info


class GenerateCluster:
    """Generation's `ClusterTask`: windows of --window-rows requests, committed as answer rows."""

    replica = "hpcinfer.tasks.generate.replica:GenerateReplica"
    window_flag, model = "--window-rows", ""
    token_kind = "completion"
    info: DecoderInfo | None = None  # set by prepare(), with the request reader, before Ray starts
    reader: RequestReader | None = None

    def prepare(self, config: RunConfig) -> None:
        if config.device.cuda_graphs:
            raise ConfigError("--cuda-graphs is not available for generation yet")
        self.info = run_decoder_info(config)
        if self.info.vision is not None and (config.device.tensor_parallel > 1 or config.device.quantize != "none"):
            raise ConfigError("a vision-language model runs on one device in float weights: not --tp, --quantize")
        self.reader = request_reader(config, self.info, load_tokenizer(self.info))  # input problems surface here
        self.model = str(self.info.path)

    def settle(self, config: RunConfig, pool: Pool, dtype: Any, fmt: str) -> tuple[RunConfig, PartStore]:
        assert self.info is not None and self.reader is not None
        # NOTE: the int8 kernel decided once (or taken over from the output resumed), so every replica
        # computes alike
        if config.device.quantize == "int8" and (recorded := recorded_fingerprint(config.output)) is not None:
            config = replace(config, device=resumed_int8(config.device, recorded))
        config = replace(config, device=settled_int8(config.device, self.info.config, INT8_ROWS))
        fp = generation_fingerprint(config, self.info, self.reader.files, dtype)
        return config, GenerationStore(config.output.path, fmt, fp, config.generate.n > 1)

    def window_rows(self, config: RunConfig) -> int:
        assert self.info is not None
        return media_windows(config, self.info).generate.window_rows

    def sources(self) -> list[Source]:
        assert self.reader is not None
        return [request_source(f, self.reader.has_ids[f]) for f in self.reader.files]

    def commit(
        self, store: PartStore, seen: IdSet, unit: Unit, result: GenerateUnitResult
    ) -> tuple[int, list[dict], dict]:
        if result.input_rows != unit.input_rows:
            raise AccountingError(f"window {unit.window_id}: {result.input_rows:,} rows of its {unit.input_rows:,}")
        answers, rejects, moved = drop_repeated_requests(seen, result.answers, result.rejects, result.admitted)
        assert isinstance(store, GenerationStore)
        assert self.reader is not None
        rows = with_errors(answers, rejects, self.reader.openai_sources)
        table = answers_table(rows, store.fmt, store.listed)
        if "custom_id" in table.column_names:
            store.id_column = "custom_id"
        store.commit_table(unit.window_id, unit.first_row, unit.input_rows, table, rejects, answered=len(answers))
        result.answers = []  # NOTE: committed; only the figures are kept for the report
        return len(answers), rejects, moved

    def tokens(self, result: GenerateUnitResult) -> int:
        return result.figures.get("completion_tokens", 0)

    def merge(self, results: list[GenerateUnitResult], wall_s: float, pool: Pool) -> ClusterGenerateReport:
        return merge_generate_reports(results, wall_s, pool.replicas)

    def finish(self, report: GenerateReport, store: PartStore, config: RunConfig) -> None:
        report.windows = len(store.windows)
        report.prefix_cache = config.generate.prefix_cache


def request_source(path: str, has_ids: bool) -> Source:
    """A request file as the unit planner sees it: which rows it holds (Parquet rows, or non-blank lines)."""
    parquet = Path(path).suffix.lower() in (".parquet", ".pq")
    return Source(path, "parquet" if parquet else "jsonl", "text", has_ids)


def drop_repeated_requests(
    seen: IdSet, answers: list[tuple[int, dict[str, Any]]], rejects: list[dict[str, Any]], admitted: list[Admitted]
) -> tuple[list[tuple[int, dict[str, Any]]], list[dict[str, Any]], dict[str, int]]:
    """A generation window less its answers to requests whose id an earlier window had.

    Returns the answers and rejects the local run commits for this window, and, per source, how
    many answers became rejects.
    """
    duplicates = repeated_rows(seen, admitted)
    if not duplicates:
        return answers, rejects, {}
    kept = [(row, answer) for row, answer in answers if row not in duplicates]
    out, moved = with_duplicate_rejects(rejects, duplicates, {row for row, _ in answers})
    assert len(kept) + len(out) == len(answers) + len(rejects), "every row answered or rejected"
    return kept, out, moved


_ADDED = (
    "prompt_tokens",
    "completion_tokens",
    "prompt_tokens_cached",
    "steps",
    "prefill_tokens",
    "decode_tokens",
    "preemptions",
    "oom_splits",
    "constrained_answers",
    "constrained_cut",
    "prefill_tokens_saved",
    "kv_evictions",
)
_SPLIT = (
    ("model", "model_s"),
    ("attention_gather", "attention_gather_s"),
    ("sampling", "sampling_s"),
    ("host", "host_s"),
)


ACTOR_COLUMNS = (
    ("actor", "device", ""),
    ("windows", "units", ","),
    ("rows", "rows", ","),
    ("tokens", "generated_tokens", ","),
    ("share", "token_share", ".1%"),
    ("busy s", "busy_s", ".3f"),
    ("busy", "busy_share", ".1%"),
    ("tok/s", "tokens_per_busy_s", ",.1f"),
    ("idle s", "idle_tail_s", ".3f"),
)


@dataclass(slots=True)
class ClusterGenerateReport(GenerateReport):
    """The generation report, plus a row per Ray actor and the cluster's figures."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    cluster: dict[str, Any] = field(default_factory=dict)

    def _device_rows(self, table: Table) -> None:
        """The actors get a table of their own (below), not the several-device rows."""

    def render(self, console: Console) -> None:
        GenerateReport.render(self, console)
        console.print(rows_table("per actor (tokens generated; tok/s of busy time)", self.devices, ACTOR_COLUMNS))
        if self.cluster:
            console.print(cluster_line(self))  # type: ignore[arg-type]


def merge_generate_reports(results: list[GenerateUnitResult], wall_s: float, replicas: int) -> ClusterGenerateReport:
    """The totals and tables of a cluster run; the caller adds rows, accounting, rejects and identity."""
    report = ClusterGenerateReport(wall_s=wall_s)
    occupancy = 0.0
    split = dict.fromkeys((name for name, _ in _SPLIT), 0.0)
    ttft: list[float] = []
    tpot: list[float] = []
    latency: dict[int, list[float]] = {}
    for r in results:
        f = r.figures
        for key in _ADDED:
            setattr(report, key, getattr(report, key) + f.get(key, 0))
        for reason, n in f.get("finish_reasons", {}).items():
            report.finish_reasons[reason] = report.finish_reasons.get(reason, 0) + n
        occupancy += f.get("occupancy_sum", 0.0)
        for name, key in _SPLIT:
            split[name] += f.get(key, 0.0)
        report.kv_blocks = max(report.kv_blocks, f.get("kv_blocks", 0))
        report.kv_block_size = max(report.kv_block_size, f.get("kv_block_size", 0))
        report.kv_cache_bytes = max(report.kv_cache_bytes, f.get("kv_cache_bytes", 0))
        report.peak_kv_blocks = max(report.peak_kv_blocks, f.get("peak_kv_blocks", 0))
        report.peak_kv_blocks_full_attention = max(
            report.peak_kv_blocks_full_attention, f.get("peak_kv_blocks_full_attention", 0)
        )
        ttft += r.ttft
        tpot += r.tpot
        for priority, values in r.latency.items():
            latency.setdefault(priority, []).extend(values)
    report.finish_reasons = dict(sorted(report.finish_reasons.items()))
    report.mean_occupancy = round(occupancy / report.steps, 4) if report.steps else 0.0
    report.step_time_split = {k: round(v, 4) for k, v in split.items()}
    report.ttft, report.tpot = percentiles(ttft), percentiles(tpot)
    report.latency_by_priority = {str(p): percentiles(v) for p, v in sorted(latency.items(), reverse=True)}
    report.devices = per_actor(
        results, wall_s, _actor_counts, "generated_tokens", ("tokens_per_busy_s", "generated_tokens")
    )
    report.cluster = cluster_figures(report.devices, replicas, "tokens_per_busy_s")
    return report


def _actor_counts(result: GenerateUnitResult) -> dict[str, int]:
    return {"rows": result.figures.get("rows", 0), "generated_tokens": result.figures.get("completion_tokens", 0)}
