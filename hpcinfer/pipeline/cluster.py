"""Embedding on a Ray cluster: what the cluster driver (ray_engine/driver.py) needs of this task.

The replicas run the local stage pipeline on their windows (replica.py); the driver commits each
window's vectors, less rows whose id an earlier window had, and merges the replicas' stage tables.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..config import RunConfig, resolve_plan
from ..errors import ConfigError
from ..files.ids import IdSet
from ..files.parts import PartStore
from ..files.sources import Source
from ..job.claim import recorded_fingerprint
from ..models.checkpoint import CheckpointInfo
from ..models.int8_kernels import resumed_int8, settled_int8
from ..obs.timing import bottleneck
from ..ray_engine.cluster import Pool
from ..ray_engine.commit import Admitted, repeated_rows, with_duplicate_rejects
from ..ray_engine.merge import cluster_figures, merge_stages, per_actor
from ..ray_engine.units import Unit
from .decode import image_budget
from .job import check_lengths, embed_fingerprint
from .options import embed_checkpoint, encoder_task
from .read import Reader
from .replica import Committed, UnitResult
from .report import RunReport


class EmbedCluster:
    """Embedding's `ClusterTask`: windows of --sort-window rows, committed as vectors."""

    replica = "hpcinfer.pipeline.replica:EmbedReplica"
    window_flag, model = "--sort-window", ""
    token_kind = "input"
    info: CheckpointInfo | None = None  # set by prepare(), before Ray starts
    reader: Reader | None = None  # set by settle(): the whole input's sources

    def prepare(self, config: RunConfig) -> None:
        if config.device.tensor_parallel > 1:
            raise ConfigError("--tp with --engine ray runs generation; a pooling task with --tp runs locally")
        if config.device.quantize in ("auto", "fp8"):
            raise ConfigError(
                f"--quantize {config.device.quantize} is not available with --engine ray for pooling tasks "
                "(int8 is: every replica quantizes the same way)"
            )
        self.info = embed_checkpoint(config)
        self.model = str(self.info.path)

    def settle(self, config: RunConfig, pool: Pool, dtype: Any, fmt: str) -> tuple[RunConfig, PartStore]:
        assert self.info is not None
        config = replace(config, plan=resolve_plan(config.plan, pool.kind, None))
        if (spec := getattr(self.info.config, "image", None)) is not None:  # NOTE: batches of pixels (decode.py)
            config = image_budget(config, spec, pool.kind)
        max_length = check_lengths(config, self.info)
        self.reader = Reader(config.input, config.plan.sort_window)
        weights = "int8" if config.device.quantize == "int8" else "float"
        # NOTE: the int8 kernel decided here once (or taken over from the output resumed), so every
        # replica computes alike
        if config.device.quantize == "int8" and (recorded := recorded_fingerprint(config.output)) is not None:
            config = replace(config, device=resumed_int8(config.device, recorded))
        rows = config.plan.max_batch_tokens or 2048
        config = replace(config, device=settled_int8(config.device, self.info.config, rows))
        fp = embed_fingerprint(config, self.info, self.reader, max_length, dtype, weights)
        return config, encoder_task(config).store(config, fmt, self.info, fp, self.reader.sources)

    def window_rows(self, config: RunConfig) -> int:
        return config.plan.sort_window

    def sources(self) -> list[Source]:
        assert self.reader is not None
        return self.reader.sources

    def commit(self, store: PartStore, seen: IdSet, unit: Unit, result: UnitResult) -> tuple[int, list[dict], dict]:
        assert [w.window_id for w in result.windows] == [unit.window_id], "a unit is one window"
        window, moved = drop_repeated_ids(seen, result.windows[0], result.admitted)
        store.commit(
            window.window_id,
            window.first_row,
            window.input_rows,
            window.ids,
            window.values,
            window.rejects,
            window.meta,
        )
        return len(window.ids), window.rejects, moved

    def tokens(self, result: UnitResult) -> int:
        return result.report.real_tokens if result.report else 0

    def merge(self, results: list[UnitResult], wall_s: float, pool: Pool) -> RunReport:
        return merge_reports(results, wall_s, pool.replicas)

    def finish(self, report: RunReport, store: PartStore, config: RunConfig) -> None:
        report.bottleneck, report.hint = bottleneck(report.stages, synchronous_device=config.device.device == "cpu")


def merge_reports(results: list[UnitResult], wall_s: float, replicas: int) -> RunReport:
    """The totals and tables of a cluster run; the driver adds accounting, rejects and identity."""
    reports = [r.report for r in results if r.report is not None]
    report = RunReport(wall_s=wall_s)
    for rep in reports:
        report.real_tokens += rep.real_tokens
        report.padded_tokens += rep.padded_tokens
        report.truncated_rows += rep.truncated_rows
        report.oom_splits += rep.oom_splits
        report.batches += rep.batches
        report.windows += rep.windows
    report.final_max_batch_tokens = min((r.final_max_batch_tokens for r in reports), default=0)
    report.stages = merge_stages(reports, wall_s, replicas)
    report.devices = per_actor(results, wall_s, _actor_counts, "tokens", ("rows_per_busy_s", "rows"))
    report.cluster = cluster_figures(report.devices, replicas, "rows_per_busy_s")
    return report


def _actor_counts(result: UnitResult) -> dict[str, int]:
    rep = result.report
    assert rep is not None
    return {"batches": rep.batches, "rows": rep.rows, "tokens": rep.real_tokens}


def drop_repeated_ids(seen: IdSet, window: Committed, admitted: list[Admitted]) -> tuple[Committed, dict[str, int]]:
    """The window less its rows whose id an earlier window had; remembers the window's other ids.

    Returns the corrected window and, per source, how many of its written rows became rejects.
    """
    duplicates = repeated_rows(seen, admitted)
    if not duplicates:
        return window, {}
    rejected = {r["row"] for r in window.rejects}
    written = [a[0] for a in admitted if a[0] not in rejected]
    assert len(written) == len(window.ids), "every admitted row is written or rejected"
    keep = np.array([row not in duplicates for row in written], dtype=bool)
    rejects, moved = with_duplicate_rejects(window.rejects, duplicates, set(written))
    ids = [i for i, k in zip(window.ids, keep, strict=True) if k]
    meta = None
    if window.meta is None:
        values = window.values[keep]
    else:
        meta = {key: [v for v, k in zip(column, keep, strict=True) if k] for key, column in window.meta.items()}
        values = window.values[np.repeat(keep, window.meta["counts"])]  # a request's values are its parts
    return Committed(window.window_id, window.first_row, window.input_rows, ids, values, rejects, meta), moved
