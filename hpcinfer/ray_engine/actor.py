"""The Ray actor of a replica: loads the task's model once, then runs the units the driver sends it.

The driver owns these actors (replicas.py) and calls them directly: `ready()` once the model is
loaded, `run(unit)` for one unit at a time, and `heartbeat()` from its `--step-timeout` watch
while a unit runs (the actor has a second thread for it). Nothing here raises to the driver: a
problem is handed back as data, classified where it happened (the task's replica), so a user's
problem ends the run as one line and a device's counts against the replica's circuit breaker.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..device.heap import keep_freed_memory
from ..device.threads import set_torch_threads
from ..errors import HpcinferError
from ..files import storage
from ..place.affinity import format_cpu_list, pin_near_gpus
from ..registry import load_object
from .beat import Beat
from .units import Unit


@dataclass(frozen=True, slots=True)
class Ready:
    """A replica's answer once its process has loaded the model (or failed to)."""

    name: str  # host:pid of this process
    error: tuple[str, int] | None = None  # a user's problem (message, exit code): the run ends
    fault: str | None = None  # a device's ("Type: message"): counts against the replica
    cores: str = ""  # --cpu-affinity auto: the cores this process was pinned to (nearest its GPUs)


class ReplicaActor:
    """One replica in a Ray actor: the task's replica, named by its import path ("package.module:Class").

    `workdir` is the driver's working directory: relative input and model paths mean what they
    meant to the driver (on a cluster, inputs and model sit on a filesystem every node mounts).
    """

    def __init__(self, config: RunConfig, workdir: str, threads: int | None, replica: str) -> None:
        keep_freed_memory()  # NOTE: a replica's process is its own, as a CLI process is
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.threads = threads
        self.beat = Beat()
        self.calls = 0
        self.replica: Any = None
        self.problem = Ready(self.name)
        try:
            if os.path.isdir(workdir):
                os.chdir(workdir)
            cores = pin_near_gpus() if config.device.cpu_affinity == "auto" else ()
            self.problem = Ready(self.name, cores=format_cpu_list(cores))
            self._set_threads()
            storage.configure(config.storage())  # NOTE: a replica reads its own rows, from the store if a URI
            self.replica = load_object(replica)(config)  # NOTE: the task's modules, only where they run
        except HpcinferError as exc:
            self.problem = Ready(self.name, error=(str(exc), exc.exit_code))
        except Exception as exc:  # noqa: BLE001 - a device that cannot load the model is the replica's fault
            self.problem = Ready(self.name, fault=f"{type(exc).__name__}: {exc}")

    def ready(self) -> Ready:
        return self.problem

    def run(self, unit: Unit) -> Any:
        """The unit's result: done, or with `error` (a user's problem) or `fault` (the device's) set."""
        self.calls += 1
        self._set_threads()
        self.beat.start()
        try:
            return self.replica.run(unit, self.beat)
        finally:
            self.beat.stop()

    def heartbeat(self) -> float:
        """Seconds since the unit in progress last moved (0 between units)."""
        return self.beat.age()

    def _set_threads(self) -> None:
        # NOTE: a thread that has run torch ops keeps its own intra-op thread count, and Ray runs
        # each call on a thread of its pool: set it where the unit runs.
        if self.threads:
            set_torch_threads(self.threads)
