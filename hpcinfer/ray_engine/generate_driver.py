"""`--engine ray` for a causal LM: the job of `run_generate`, its windows answered by Ray Data actors.

As for embedding (`driver.py`): the driver checks the inputs, output and model as a local run does,
takes the output's lock and cuts the request files into the local run's windows of
`--window-rows` global input rows (`units.py`), with the local run's fingerprint, so `--resume`
works on either engine and refuses changed inputs or options. Each actor loads the decoder once
and runs generation's own engine over each window it gets (`generate_replica.py`). The driver
alone writes: it turns ids repeated across windows into `duplicate_id` rejects, commits each
window's answers as a part, in window order, assembles OUTPUT and merges the actors' figures.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import RunConfig, flatten
from ..errors import ConfigError, Interrupted, OutputError
from ..files.ids import IdSet, id_key
from ..files.sources import Source
from ..job.accounting import AccountingError, settle
from ..job.claim import claimed, open_store
from ..job.output_checks import check_output, output_format
from ..job.rejects import RejectCounter
from ..models.decoder_checkpoint import inspect_decoder
from ..models.registry import resolve_model_path
from ..obs.progress import Progress
from ..tasks.generate.answers import GenerationStore, answers_table
from ..tasks.generate.report import GenerateReport
from ..tasks.generate.requests import RequestReader
from ..tasks.generate.setup import generation_fingerprint, load_tokenizer, request_reader
from .actor import ReplicaActor
from .commit import drop_repeated_requests, reject_from_json
from .driver import (
    Pool,
    _connect,
    _dtype,
    _import_ray,
    _refuse_unsupported,
    _resources,
    _resumed_by_file,
    commit_in_order,
    run_units,
)
from .generate_merge import merge_generate_reports
from .generate_replica import GenerateUnitResult
from .units import Unit, plan_units


def run_generate_on_ray(
    config: RunConfig, *, progress: Progress | None = None, replica_cls: type = ReplicaActor
) -> GenerateReport:
    """`run_generate` on a Ray cluster (or a local Ray instance started for the run).

    `replica_cls` is the actor class (tests pass one that dies on purpose).
    """
    _refuse_unsupported(config)
    if config.device.cuda_graphs:
        raise ConfigError("--cuda-graphs is not available for generation yet")
    ray = _import_ray()
    fmt = output_format(config.output.path, config.output.output_format)
    check_output(config.output.path)
    info = inspect_decoder(resolve_model_path(config.model))
    reader = request_reader(config, info, load_tokenizer(info))  # input problems surface here, before Ray starts
    started = _connect(ray, config.cluster.ray_address)
    try:
        replicas, cpus, gpus, kind = _resources(ray, config)
        # NOTE: the replicas run on what Ray hands out, not on what the driver's machine has.
        config = replace(config, device=replace(config.device, device=kind))
        dtype = _dtype(ray, config, kind, gpus)
        store = GenerationStore(config.output.path, fmt, 0, generation_fingerprint(config, info, reader.files, dtype))
        with claimed(store, config.output.path):
            job = _GenerateJob(config, store, reader, Pool(replicas, cpus, gpus, kind), str(dtype))
            return job.run(ray, replica_cls, progress or Progress(config.pipeline.progress), str(info.path))
    finally:
        if started:
            ray.shutdown()


class _CommittedIds:
    """What `open_store` tells a reader on resume (rows to skip, ids written), kept for the driver."""

    def __init__(self, seen: IdSet) -> None:
        self.seen = seen
        self.skip_rows = 0

    def remember_ids(self, ids: Any) -> None:
        self.seen.update(id_key(i) for i in ids if i is not None)  # NOTE: as `RequestReader.remember_ids`


class _GenerateJob:
    """One cluster generation run holding the output's lock: the units, the actor pool, the ordered commit."""

    def __init__(
        self, config: RunConfig, store: GenerationStore, reader: RequestReader, pool: Pool, dtype: str
    ) -> None:
        self.config, self.store, self.reader, self.pool = config, store, reader, pool
        self.dtype = dtype.removeprefix("torch.")
        self.rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
        self.seen = IdSet()
        self.read: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.results: list[GenerateUnitResult] = []
        self.ray_stats: dict[str, Any] = {}

    def run(self, ray: Any, replica_cls: type, progress: Progress, model: str) -> GenerateReport:
        config, store, window = self.config, self.store, self.config.generate.window_rows
        first_window = open_store(store, _CommittedIds(self.seen), config.output)  # type: ignore[arg-type]
        if any(w["first_row"] != k * window for k, w in enumerate(store.windows)):
            raise OutputError(
                "cannot resume on Ray: the committed windows are not --window-rows rows each", path=config.output.path
            )
        resumed_rows, resumed_written = store.rows_committed, store.rows_written
        sources = [_source(f, self.reader.has_ids[f]) for f in self.reader.files]
        units, totals = plan_units(sources, window, first_window)
        progress.set_total(sum(u.input_rows for u in units))
        expected = {u.window_id: u for u in units}
        start = time.perf_counter()
        stream = run_units(ray, replica_cls, units, config, self.pool, "generate", self.ray_stats)
        try:
            commit_in_order(
                stream, first_window, len(units), lambda r: self._commit(r, expected[r.window_id], progress)
            )
        except KeyboardInterrupt:  # the committed windows stay: say so, and how to resume
            raise Interrupted(signal.SIGINT, store.rows_written, config.output.path) from None
        finally:
            progress.close()
        resumed = _resumed_by_file(sources, totals, resumed_rows)
        report = merge_generate_reports(self.results, time.perf_counter() - start, self.pool.replicas)
        report.accounting = settle(
            ((s.path, self.read.get(s.path, 0) + resumed[s.path], resumed[s.path]) for s in sources),
            self.written,
            self.rejects.by_source,
        )
        store.assemble()
        report.wall_s = time.perf_counter() - start
        report.rows, report.rows_resumed = store.rows_written, resumed_written
        report.windows = len(store.windows)
        report.rejects = dict(sorted(self.rejects.by_reason.items()))
        replicas = self.pool.replicas
        report.device = f"ray: {replicas} replica{'s' if replicas > 1 else ''} ({self.pool.kind})"
        report.dtype, report.model, report.output = self.dtype, model, config.output.path
        report.prefix_cache = config.generate.prefix_cache
        report.cluster.update(self.ray_stats)
        report.config = flatten(config)
        if config.report_path:
            report.write_json(config.report_path)
        return report

    def _commit(self, result: GenerateUnitResult, unit: Unit, progress: Progress) -> None:
        read = sum(result.read_by_source.values())
        if read != unit.input_rows or result.input_rows != unit.input_rows:
            raise AccountingError(f"window {unit.window_id}: {read:,} rows read of its {unit.input_rows:,}")
        answers, rejects, moved = drop_repeated_requests(self.seen, result.answers, result.rejects, result.admitted)
        self.rejects.add([reject_from_json(r) for r in rejects])
        table = answers_table([answer for _, answer in answers], self.store.fmt)
        if "custom_id" in table.column_names:
            self.store.id_column = "custom_id"
        self.store.commit_table(unit.window_id, unit.first_row, unit.input_rows, table, rejects)
        self.rejects.check_fraction(self.store.rows_committed)
        for path, n in result.read_by_source.items():
            self.read[path] = self.read.get(path, 0) + n
        for path, n in result.written_by_source.items():
            self.written[path] = self.written.get(path, 0) + n - moved.get(path, 0)
        result.answers = []  # NOTE: committed; only the figures are kept for the report
        self.results.append(result)
        progress.advance(len(answers), result.figures.get("completion_tokens", 0))


def _source(path: str, has_ids: bool) -> Source:
    """A request file as the unit planner sees it: which rows it holds (Parquet rows, or non-blank lines)."""
    parquet = Path(path).suffix.lower() in (".parquet", ".pq")
    return Source(path, "parquet" if parquet else "jsonl", "text", has_ids)
