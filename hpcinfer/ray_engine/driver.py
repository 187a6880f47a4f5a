"""`--engine ray`: a run's windows done by replicas in Ray actors, for any task.

What runs where. The driver (this process) checks the inputs, output and model as a local run
does, takes the output's lock, cuts the input into the local run's windows (`units.py`) and
starts `--replicas` actors (replicas.py), each loading the model once. It hands the windows out
itself, one at a time per replica, lowest first (schedule.py): each replica runs the task's own
engine on its window (the task's `replica.py`). Results come back to the driver, which alone
writes: it turns ids repeated across windows into rejects, commits each window as a part in the
manifest, in window order, and assembles OUTPUT as a local run does. A window is committed once,
by the driver, whichever attempt delivered it, so no row is ever written twice; a kill of the
driver leaves a committed prefix that `--resume` (on either engine) continues.

A circuit breaker per replica (place/breaker.py, as for local devices) keeps work away from a
replica that keeps failing: a device fault, a hang past `--step-timeout` or a process that died
counts against it, and its window is redone on another replica; Ray replaces the process. Only
when every replica is open does the run fail, naming each, its committed windows kept.

What differs between tasks (which model facts, which store, how a window's results are
committed, how the replicas' figures merge) is the task's `ClusterTask` (tasks/*/cluster.py).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any, Protocol

from ..config import RunConfig, flatten
from ..errors import HpcinferError, Interrupted, OutputError, StageError
from ..files.ids import IdSet, id_key
from ..files.parts import PartStore
from ..files.sources import Source
from ..job.accounting import AccountingError, books, settle, watch_output
from ..job.claim import claimed, open_store
from ..job.output_checks import check_output, output_format
from ..job.rejects import RejectCounter
from ..obs.progress import Progress
from ..place.breaker import Transition, breaker_settings
from .actor import ReplicaActor
from .cluster import Pool, connect, import_ray, refuse_unsupported, replica_dtype, resources, start_replicas
from .commit import reject_from_json
from .schedule import ReplicaError, Scheduler
from .units import Unit, plan_units


class ClusterTask(Protocol):
    """What a task tells the cluster driver (one class per task, in tasks/<task>/cluster.py)."""

    replica: str  # the replica the actors build, by import path ("package.module:Class")
    window_flag: str  # the option that sizes a window (resume needs the committed ones whole)
    token_kind: str  # what `tokens` counts: input (the pooling tasks) or completion (generation)
    model: str  # the checkpoint, as the report names it

    def prepare(self, config: RunConfig) -> None:
        """Model facts and input problems, found before Ray starts."""

    def settle(self, config: RunConfig, pool: Pool, dtype: Any, fmt: str) -> tuple[RunConfig, PartStore]:
        """The run's config for the pool's devices, and its output store (with its fingerprint)."""

    def window_rows(self, config: RunConfig) -> int: ...

    def sources(self) -> list[Source]: ...

    def commit(self, store: PartStore, seen: IdSet, unit: Unit, result: Any) -> tuple[int, list[dict], dict]:
        """Commits one unit's window, ids repeated across windows made rejects: (rows written, rejects,
        rows moved to rejects per source)."""

    def tokens(self, result: Any) -> int:
        """The unit's tokens, for the progress line."""

    def merge(self, results: list[Any], wall_s: float, pool: Pool) -> Any:
        """The replicas' figures as one report."""

    def finish(self, report: Any, store: PartStore, config: RunConfig) -> None:
        """The task's own lines of the report, once the output is assembled."""


def run_on_ray(
    config: RunConfig,
    task: ClusterTask,
    *,
    progress: Progress | None = None,
    replica_cls: type = ReplicaActor,
    stop: threading.Event | None = None,
) -> Any:
    """`api.run` on a Ray cluster (or a local Ray instance started for the run).

    `replica_cls` is the actor class (tests pass one that dies on purpose); `stop`, set from another
    thread, ends the run between units as Ctrl-C does (`Interrupted`; the committed windows stay).
    """
    refuse_unsupported(config)
    breaker_settings(config.device)  # NOTE: a bad value is refused before Ray starts
    ray = import_ray()
    fmt = output_format(config.output.path, config.output.output_format)
    check_output(config.output.path)
    task.prepare(config)
    started = connect(ray, config.cluster.ray_address)
    try:
        pool = resources(ray, config)
        # NOTE: the replicas run on what Ray hands out, not on what the driver's machine has.
        config = replace(config, device=replace(config.device, device=pool.kind))
        dtype = replica_dtype(ray, config, pool)
        config, store = task.settle(config, pool, dtype, fmt)
        with claimed(store, config.output):
            job = ClusterJob(config, task, store, pool, str(dtype).removeprefix("torch."))
            return job.run(ray, replica_cls, progress or Progress(config.pipeline.progress), stop)
    finally:
        if started:
            ray.shutdown()


class _CommittedIds:
    """What `open_store` tells a reader on resume (rows to skip, ids written), kept for the driver."""

    def __init__(self, seen: IdSet) -> None:
        self.seen = seen
        self.skip_rows = 0

    def remember_ids(self, ids: Any) -> None:
        self.seen.update(id_key(i) for i in ids if i is not None)


class ClusterJob:
    """One cluster run holding the output's lock: the units, the actor pool, the ordered commit."""

    def __init__(self, config: RunConfig, task: ClusterTask, store: PartStore, pool: Pool, dtype: str) -> None:
        self.config, self.task, self.store, self.pool, self.dtype = config, task, store, pool, dtype
        self.rejects = RejectCounter(config.output.max_rejects, config.output.max_reject_fraction)
        self.seen = IdSet()
        self.read: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.results: list[Any] = []

    def run(self, ray: Any, replica_cls: type, progress: Progress, stop: threading.Event | None = None) -> Any:
        config, store, window = self.config, self.store, self.task.window_rows(self.config)
        first_window = open_store(store, _CommittedIds(self.seen), config.output)
        if any(w["first_row"] != k * window for k, w in enumerate(store.windows)):
            raise OutputError(
                f"cannot resume on Ray: the committed windows are not {self.task.window_flag} rows each",
                path=config.output.path,
            )
        resumed_rows, resumed_written = store.rows_committed, store.rows_written
        watch_output(progress.meter, store, self.rejects, resumed_written)  # NOTE: the cluster's totals
        sources = self.task.sources()
        units, totals = plan_units(sources, window, first_window)
        progress.set_total(sum(u.input_rows for u in units))
        expected = {u.window_id: u for u in units}
        start = time.perf_counter()

        def tell(t: Transition) -> None:
            progress.breaker(t.device, t.state, f"hpcinfer: {t.device} {t.state} at {t.at_s:.1f} s: {t.reason}")

        replicas = start_replicas(ray, replica_cls, config, self.pool, self.task.replica, tell)
        schedule = Scheduler(ray, replicas, units, config.device.step_timeout, progress, stop)
        try:
            commit_in_order(
                schedule.results(),
                first_window,
                len(units),
                lambda r: self._commit(r, expected[r.window_id], progress),
            )
        except KeyboardInterrupt:  # the committed windows stay: say so, and how to resume
            raise Interrupted(signal.SIGINT, store.rows_written, config.output.path) from None
        finally:
            replicas.close()
            progress.close()
        resumed = _resumed_by_file(sources, totals, resumed_rows)
        report = self.task.merge(self.results, time.perf_counter() - start, self.pool)
        report.accounting = settle(
            ((s.path, self.read.get(s.path, 0) + resumed[s.path], resumed[s.path]) for s in sources),
            self.written,
            self.rejects.by_source,
        )
        store.assemble()
        report.wall_s = time.perf_counter() - start
        report.rows, report.rows_resumed = store.rows_written, resumed_written
        books(report)
        report.rejects = dict(sorted(self.rejects.by_reason.items()))
        n = self.pool.replicas
        report.device = f"ray: {n} replica{'s' if n > 1 else ''} ({self.pool.kind})"
        report.dtype, report.model, report.output = self.dtype, self.task.model, config.output.path
        report.cluster.update(schedule.figures())
        report.device_faults = [asdict(t) for t in replicas.log.transitions]
        report.config = flatten(config)
        self.task.finish(report, store, config)
        return report

    def _commit(self, result: Any, unit: Unit, progress: Progress) -> None:
        read = sum(result.read_by_source.values())
        if read != unit.input_rows:
            raise AccountingError(f"window {unit.window_id}: {read:,} rows read of its {unit.input_rows:,}")
        written, rejects, moved = self.task.commit(self.store, self.seen, unit, result)
        self.rejects.add([reject_from_json(r) for r in rejects])
        self.rejects.check_fraction(self.store.rows_committed)
        for path, n in result.read_by_source.items():
            self.read[path] = self.read.get(path, 0) + n
        for path, n in result.written_by_source.items():
            self.written[path] = self.written.get(path, 0) + n - moved.get(path, 0)
        self.results.append(result)
        tokens = self.task.tokens(result)
        progress.meter.add(f"tokens.{self.task.token_kind}", tokens)
        replica = str(getattr(result, "replica", "") or "replica").split()[0]  # NOTE: "replica#0 <its actor>"
        progress.meter.add(f"device_rows.{replica}", written)
        progress.meter.add(f"device_tokens.{replica}", tokens)
        progress.advance(written, tokens)


def commit_in_order(results: Iterator[Any], first_window: int, count: int, commit: Callable[[Any], None]) -> None:
    """Commits units' results in window order, whatever order they come back in; all `count` must come.

    A user's problem found by a replica, or every replica failing, stops the run with its one
    line; any other failure (of Ray itself) becomes one line too.
    """
    pending: dict[int, Any] = {}
    next_window = first_window
    try:
        for result in results:
            pending[result.window_id] = result
            while next_window in pending:
                commit(pending.pop(next_window))
                next_window += 1
    except (HpcinferError, StageError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - Ray's own failure: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ReplicaError(f"the Ray job failed: {type(exc).__name__}: {first}", 1) from exc
    if next_window != first_window + count:
        raise AccountingError(f"windows {next_window}-{first_window + count - 1} never came back from Ray")


def _resumed_by_file(sources: list, totals: dict[str, int], resumed_rows: int) -> dict[str, int]:
    """Input rows of each file inside the windows committed before this run (as the local reader counts them)."""
    out, first = {}, 0
    for s in sources:
        out[s.path] = max(0, min(resumed_rows, first + totals[s.path]) - first)
        first += totals[s.path]
    return out
