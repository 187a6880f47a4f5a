"""Test-only pieces of the Ray engine's tests: a local Ray instance per module, and an actor that
dies once, on purpose, in the middle of a run.

Kept out of the product: the engine takes its actor class as an argument (`run_on_ray(...,
replica_cls=...)`), and only tests pass these.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcinfer.ray_engine.actor import ReplicaActor

REPO = Path(__file__).resolve().parent.parent


def local_ray() -> Iterator[str]:
    """A module fixture's body: one local Ray instance (2 CPUs, a small object store); yields its address."""
    import ray

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=2,
        object_store_memory=300 * 2**20,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}},
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


class DiesOnceActor(ReplicaActor):
    """Exits its process (no cleanup, as a crash or an OOM kill would) on its second unit, once per run.

    The marker file next to the output says it happened, so the restarted actor, and every other
    one, carries on normally.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker = Path(self.replica.config.output.path + ".died")

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.calls == 1:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os._exit(1)
        return super().__call__(batch)
