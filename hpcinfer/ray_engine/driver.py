"""`--engine ray`: the embedding job of `api.run`, its windows embedded by replicas in Ray Data actors.

What runs where. The driver (this process) checks the inputs, output and model as a local run
does, takes the output's lock, cuts the input into the local engine's windows (`units.py`) and
hands them to Ray Data: `map_batches(ReplicaActor, concurrency=N)` over one block per window, so
Ray schedules the windows on an actor pool, restarts an actor that dies and redoes its windows.
Each actor runs hpcinfer's own engine on its window (`replica.py`). Results come back to the
driver, which alone writes: it drops ids repeated across windows, commits each window as a part
in the manifest, in window order, and assembles OUTPUT as a local run does. A window is committed
once, by the driver, whatever Ray retried, so no row is ever written twice; a kill of the driver
leaves a committed prefix that `--resume` (on either engine) continues.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..config import RunConfig, flatten, resolve_plan
from ..errors import ConfigError, HpcinferError, Interrupted, OutputError
from ..files.ids import IdSet, id_key
from ..files.parts import PartStore
from ..files.read import Reader
from ..job.accounting import AccountingError, settle
from ..job.claim import claimed, open_store
from ..job.output_checks import check_output, output_format
from ..job.rejects import RejectCounter
from ..models.checkpoint import inspect_checkpoint
from ..models.registry import resolve_model_path
from ..obs.progress import Progress
from ..obs.timing import bottleneck
from ..tasks.embed.job import check_lengths, embed_fingerprint
from ..tasks.embed.report import RunReport
from .actor import ReplicaActor
from .commit import drop_repeated_ids, reject_from_json
from .merge import merge_reports
from .replica import UnitResult
from .units import plan_units


class RayUnitError(HpcinferError):
    """A replica's unit failed for a user's reason (a file changed under the run, say)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_on_ray(config: RunConfig, *, progress: Progress | None = None, replica_cls: type = ReplicaActor) -> RunReport:
    """`api.run` on a Ray cluster (or a local Ray instance started for the run).

    `replica_cls` is the actor class (tests pass one that dies on purpose).
    """
    _refuse_unsupported(config)
    ray = _import_ray()
    fmt = output_format(config.output.path, config.output.output_format)
    check_output(config.output.path)
    info = inspect_checkpoint(resolve_model_path(config.model))
    started = _connect(ray, config.cluster.ray_address)
    try:
        replicas, cpus, gpus, kind = _resources(ray, config)
        config = replace(config, plan=resolve_plan(config.plan, kind, None))
        max_length = check_lengths(config, info)
        reader = Reader(config.input, config.plan.sort_window)
        dtype = _dtype(ray, config, kind, gpus)
        fp = embed_fingerprint(config, info, reader, max_length, dtype)
        store = PartStore(config.output.path, fmt, info.config.hidden_size, fp)
        with claimed(store, config.output.path):
            job = _Job(config, store, reader, replicas, cpus, gpus, kind, str(dtype).removeprefix("torch."))
            return job.run(ray, replica_cls, progress or Progress(config.pipeline.progress), str(info.path))
    finally:
        if started:
            ray.shutdown()


def _refuse_unsupported(config: RunConfig) -> None:
    for flag, given in (
        ("--rate", config.input.rate is not None),
        ("--batch-timeout-ms", config.plan.batch_timeout_ms is not None),
        ("--trace", config.trace_path is not None),
        ("--devices", config.device.devices is not None),
        ("--limit", config.input.limit is not None),
    ):
        if given:
            raise ConfigError(f"{flag} is not available with --engine ray")
    if config.device.device.startswith("cuda") and not config.cluster.gpus_per_replica:
        raise ConfigError("--device cuda with --engine ray needs --gpus-per-replica (Ray hands out the GPUs)")


def _import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ConfigError("--engine ray needs Ray: pip install 'hpcinfer[ray]'") from None
    return ray


def _connect(ray: Any, address: str | None) -> bool:
    """Joins the cluster at `address`, or starts a local instance; True when this run started it."""
    if ray.is_initialized():
        return False  # a caller (a notebook, a test) has connected already: theirs to shut down
    try:
        if address:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
            return True
        ray.init(include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot reach a Ray cluster at {address or 'a local instance'}: {exc}") from None
    return True


def _resources(ray: Any, config: RunConfig) -> tuple[int, int, float, str]:
    """(replicas, CPUs per replica, GPUs per replica, device kind) for this cluster."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    node_cpus = min(int(n.get("CPU", 0)) for n in nodes) if nodes else 1
    gpus = config.cluster.gpus_per_replica
    if gpus:
        total_gpus = sum(n.get("GPU", 0) for n in nodes)
        replicas = config.cluster.replicas or max(1, int(total_gpus // gpus))
        if replicas * gpus > total_gpus:
            raise ConfigError(
                f"--replicas {replicas} x --gpus-per-replica {gpus:g} exceeds the cluster's {total_gpus:g} GPUs"
            )
        return replicas, 1, gpus, "cuda"
    replicas = config.cluster.replicas or len(nodes)  # NOTE: on CPUs one replica per node uses all its cores
    per_node = math.ceil(replicas / max(1, len(nodes)))
    return replicas, max(1, node_cpus // per_node), 0.0, "cpu"


def _dtype(ray: Any, config: RunConfig, kind: str, gpus: float) -> Any:
    """The dtype the replicas will use, for the fingerprint; `auto` on CUDA is asked of a GPU worker."""
    import torch

    from ..device import dtype_for

    if config.device.dtype != "auto" or kind == "cpu":
        return dtype_for(config.device.dtype, torch.device(kind))

    @ray.remote(num_gpus=gpus)
    def half() -> str:
        from hpcinfer.device.cuda import best_half_dtype  # NOTE: absolute: this function is shipped by value

        return str(best_half_dtype(torch.device("cuda")))

    return getattr(torch, ray.get(half.remote()).removeprefix("torch."))


class _Job:
    """One cluster run holding the output's lock: the units, the actor pool, the ordered commit."""

    def __init__(self, config, store, reader, replicas, cpus, gpus, kind, dtype) -> None:  # noqa: ANN001
        self.config, self.store, self.reader = config, store, reader
        self.replicas, self.cpus, self.gpus, self.kind, self.dtype = replicas, cpus, gpus, kind, dtype
        self.rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
        self.seen = IdSet()
        self.read: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.results: list[UnitResult] = []
        self.rows_written_now = 0  # rows this run committed (the rows_resumed of the report are the others)
        self.ray_stats: dict[str, Any] = {}

    def run(self, ray: Any, replica_cls: type, progress: Progress, model: str) -> RunReport:
        config, store, window = self.config, self.store, self.config.plan.sort_window
        first_window = open_store(store, self.reader, config.output)
        if any(w["first_row"] != k * window for k, w in enumerate(store.windows)):
            raise OutputError(
                "cannot resume on Ray: the committed windows are not --sort-window rows each", path=config.output.path
            )
        resumed_rows = store.rows_committed
        if any(s.has_ids for s in self.reader.sources):
            self.seen.add_many(self._committed_keys())
        units, totals = plan_units(self.reader.sources, window, first_window)
        progress.set_total(sum(u.input_rows for u in units))
        start = time.perf_counter()
        pool = Pool(self.replicas, self.cpus, self.gpus, self.kind)
        stream = run_units(ray, replica_cls, units, config, pool, "embed", self.ray_stats)
        expected = {u.window_id: u for u in units}
        try:
            commit_in_order(
                stream, first_window, len(units), lambda r: self._commit(r, expected[r.window_id], progress)
            )
        except KeyboardInterrupt:  # the committed windows stay: say so, and how to resume
            raise Interrupted(signal.SIGINT, store.rows_written, config.output.path) from None
        finally:
            progress.close()
        wall = time.perf_counter() - start
        report = self._report(_resumed_by_file(self.reader.sources, totals, resumed_rows), wall, model)
        store.assemble()
        report.wall_s = time.perf_counter() - start
        if config.report_path:
            report.write_json(config.report_path)
        return report

    def _committed_keys(self) -> Any:
        import numpy as np

        ids = [i for i in self.store.committed_ids() if i is not None]
        return np.unique(np.fromiter((id_key(i) for i in ids), np.uint64, len(ids)))

    def _commit(self, result: UnitResult, unit: Any, progress: Progress) -> None:
        assert [w.window_id for w in result.windows] == [unit.window_id], "a unit is one window"
        read = sum(result.read_by_source.values())
        if read != unit.input_rows:
            raise AccountingError(f"window {unit.window_id}: {read:,} rows read of its {unit.input_rows:,}")
        window, moved = drop_repeated_ids(self.seen, result.windows[0], result.admitted)
        self.rejects.add([reject_from_json(r) for r in window.rejects])
        self.store.commit(
            window.window_id, window.first_row, window.input_rows, window.ids, window.values, window.rejects
        )
        self.rejects.check_fraction(self.store.rows_committed)
        self.rows_written_now += len(window.ids)
        for path, n in result.read_by_source.items():
            self.read[path] = self.read.get(path, 0) + n
        for path, n in result.written_by_source.items():
            self.written[path] = self.written.get(path, 0) + n - moved.get(path, 0)
        self.results.append(result)
        report = result.report
        progress.advance(len(window.ids), report.real_tokens if report else 0)

    def _report(self, resumed: dict[str, int], wall: float, model: str) -> RunReport:
        accounting = settle(
            ((s.path, self.read.get(s.path, 0) + resumed[s.path], resumed[s.path]) for s in self.reader.sources),
            self.written,
            self.rejects.by_source,
        )
        report = merge_reports(self.results, wall, self.replicas)
        report.accounting = accounting
        report.rows = self.store.rows_written
        report.rows_resumed = self.store.rows_written - self.rows_written_now
        report.rejects = dict(sorted(self.rejects.by_reason.items()))
        report.device = f"ray: {self.replicas} replica{'s' if self.replicas > 1 else ''} ({self.kind})"
        report.dtype, report.model, report.output = self.dtype, model, self.config.output.path
        report.bottleneck, report.hint = bottleneck(report.stages, synchronous_device=self.kind == "cpu")
        report.cluster.update(self.ray_stats)
        report.config = flatten(self.config)
        return report


@dataclass(frozen=True, slots=True)
class Pool:
    """The actor pool of a run: how many replicas, and what each one gets from Ray."""

    replicas: int
    cpus: int
    gpus: float
    kind: str  # cpu | cuda


def run_units(
    ray: Any, replica_cls: type, units: list, config: RunConfig, pool: Pool, task: str, stats: dict[str, Any]
) -> Iterator[Any]:
    """Every unit through the actor pool; yields each unit's result as it comes back (any order).

    Ray Data's own figures for the dataset land in `stats` once every result is back.
    """
    if not units:
        return
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    items = [{"unit": pickle.dumps(u, protocol=pickle.HIGHEST_PROTOCOL)} for u in units]
    threads = config.device.threads or (pool.cpus if pool.kind == "cpu" else None)
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        replica_cls,
        fn_constructor_kwargs={"config": config, "workdir": os.getcwd(), "threads": threads, "task": task},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=pool.replicas),
        num_cpus=pool.cpus,
        num_gpus=pool.gpus or None,
        # NOTE: Ray Data restarts a dead actor and redoes its unit on it (max_restarts and
        # max_task_retries default to -1 for actor pools); the driver commits each window
        # once, whichever attempt delivered it.
    )
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=pool.replicas):
        for blob in batch["result"]:
            yield pickle.loads(blob)
    stats.update(_ray_stats(ds))


def commit_in_order(results: Iterator[Any], first_window: int, count: int, commit: Callable[[Any], None]) -> None:
    """Commits units' results in window order, whatever order they come back in; all `count` must come.

    A result with an `error` (a user's problem, found by a replica) stops the run with that message;
    a failure of Ray itself (an actor that cannot start, ...) becomes one line.
    """
    pending: dict[int, Any] = {}
    next_window = first_window
    try:
        for result in results:
            if result.error is not None:
                raise RayUnitError(*result.error)
            pending[result.window_id] = result
            while next_window in pending:
                commit(pending.pop(next_window))
                next_window += 1
    except (HpcinferError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - Ray's own failure: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RayUnitError(f"the Ray job failed: {type(exc).__name__}: {first}", 1) from exc
    if next_window != first_window + count:
        raise AccountingError(f"windows {next_window}-{first_window + count - 1} never came back from Ray")


def _resumed_by_file(sources: list, totals: dict[str, int], resumed_rows: int) -> dict[str, int]:
    """Input rows of each file inside the windows committed before this run (as the local reader counts them)."""
    out, first = {}, 0
    for s in sources:
        out[s.path] = max(0, min(resumed_rows, first + totals[s.path]) - first)
        first += totals[s.path]
    return out


def _ray_stats(ds: Any) -> dict[str, Any]:
    """Ray Data's own figures for this dataset, where this Ray version exposes them (a private API)."""
    try:
        summary = ds._get_stats_summary()
    except Exception:  # noqa: BLE001 - statistics are a nicety; their absence never fails a run
        return {}
    spilled = failed = 0

    def walk(stats: Any) -> None:
        nonlocal spilled, failed
        for op in [stats, *getattr(stats, "operators_stats", [])]:
            extra = getattr(op, "extra_metrics", None) or {}
            spilled += int(extra.get("obj_store_mem_spilled", 0) or 0)
            failed += int(extra.get("num_tasks_failed", 0) or 0)
        for parent in getattr(stats, "parents", []):
            walk(parent)

    walk(summary)
    return {
        "object_store_spilled_bytes": spilled,
        "cluster_spilled_bytes": int(getattr(summary, "global_bytes_spilled", 0) or 0),
        "tasks_failed": failed,
    }
