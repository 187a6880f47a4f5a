"""Talking to Ray: joining or starting a cluster, the actor pool a run gets, and every unit through it."""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Pool:
    """The actor pool of a run: how many replicas, and what each one gets from Ray."""

    replicas: int
    cpus: int
    gpus: float
    kind: str  # cpu | cuda


def refuse_unsupported(config: RunConfig) -> None:
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


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ConfigError("--engine ray needs Ray: pip install 'hpcinfer[ray]'") from None
    return ray


def connect(ray: Any, address: str | None) -> bool:
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


def resources(ray: Any, config: RunConfig) -> Pool:
    """The actor pool this cluster gives the run: replicas, CPUs and GPUs per replica, device kind."""
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
        return Pool(replicas, 1, gpus, "cuda")
    replicas = config.cluster.replicas or len(nodes)  # NOTE: on CPUs one replica per node uses all its cores
    per_node = math.ceil(replicas / max(1, len(nodes)))
    return Pool(replicas, max(1, node_cpus // per_node), 0.0, "cpu")


def replica_dtype(ray: Any, config: RunConfig, pool: Pool) -> Any:
    """The dtype the replicas will use, for the fingerprint; `auto` on CUDA is asked of a GPU worker."""
    import torch

    from ..device import dtype_for

    if config.device.dtype != "auto" or pool.kind == "cpu":
        return dtype_for(config.device.dtype, torch.device(pool.kind))

    @ray.remote(num_gpus=pool.gpus)
    def half() -> str:
        from hpcinfer.device.cuda import best_half_dtype  # NOTE: absolute: this function is shipped by value

        return str(best_half_dtype(torch.device("cuda")))

    return getattr(torch, ray.get(half.remote()).removeprefix("torch."))


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
    stats.update(ray_stats(ds))


def ray_stats(ds: Any) -> dict[str, Any]:
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
