"""Talking to Ray: joining or starting a cluster, the resources a run gets, and its replicas' actors."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from ..place.breaker import breaker_settings
from .replicas import ReplicaSet


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
    tp, gpus = config.device.tensor_parallel, config.cluster.gpus_per_replica
    if tp > 1 and 0 < gpus < tp:  # NOTE: each replica is a --tp group: its ranks need a GPU each
        raise ConfigError(f"--tp {tp} with --engine ray on GPUs needs --gpus-per-replica {tp} (got {gpus:g})")


def import_ray() -> Any:
    try:
        import ray
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
        # NOTE: Ray runs its workers at nice 15 by default; the replicas of an instance a run starts
        # are the run itself, and at nice 15 beside other work they get a few percent of a core
        # (a 10 s run took 95 s beside two busy processes)
        ray.init(
            include_dashboard=False,
            logging_level="WARNING",
            log_to_driver=False,
            _system_config={"worker_niceness": 0},
        )
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


def start_replicas(
    ray: Any, replica_cls: type, config: RunConfig, pool: Pool, replica: str, listener: Callable[[Any], None]
) -> ReplicaSet:
    """The run's replicas, each an actor with the pool's CPUs and GPUs, loading the model (`listener`
    hears each breaker transition)."""
    threads = config.device.threads or (pool.cpus if pool.kind == "cpu" else None)
    args = {"config": config, "workdir": os.getcwd(), "threads": threads, "replica": replica}
    options: dict[str, Any] = {"num_cpus": pool.cpus}
    if pool.gpus:
        options["num_gpus"] = pool.gpus
    settings = breaker_settings(config.device)
    return ReplicaSet(ray, replica_cls, pool.replicas, args, options, settings, listener)
