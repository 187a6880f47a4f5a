"""Test-only pieces of the Ray engine's tests: a local Ray instance per module, and actors that die,
fail or hang on purpose in the middle of a run.

Kept out of the product: the engine takes its actor class as an argument (`run_on_ray(...,
replica_cls=...)`), and only tests pass these. A fault is injected where a real one would come
from: the device's forward (embedding) or an engine step (generation), so the replica's own
classification sees it. Marker files next to the output carry what must outlive a process (Ray
replaces a faulted replica's process): which replica is the faulty one (by its Ray actor id, the
same across its restarts) and how often it failed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcinfer.ray_engine.actor import ReplicaActor
from tests.fixtures.warm_cli import WarmPopen

REPO = Path(__file__).resolve().parents[2]
WARM_RAY_WORKER = REPO / "tests" / "fixtures" / "warm_ray_worker.py"


def local_ray(cpus: int = 2) -> Iterator[str]:
    """A module fixture's body: one local Ray instance (`cpus` CPUs, a small object store); yields its address."""
    import ray

    # NOTE: the workers inherit the environment of the instance ray.init starts here; a runtime_env
    # would do the same but starts every worker through Ray's setup_worker.py, an interpreter that
    # imports Ray only to exec the worker's own
    names = ("PYTHONPATH", "HF_HUB_OFFLINE", "HPCINFER_TEST_WARM_SOCKET", "HPCINFER_TEST_RAY_WORKER")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), saved["PYTHONPATH"] or "") if p)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with _warm_ray_workers(ray):
            ray.init(
                num_cpus=cpus,
                object_store_memory=300 * 2**20,
                include_dashboard=False,
                logging_level="WARNING",
                log_to_driver=False,
                # NOTE: as the local instance a run starts (ray_engine/cluster.py): Ray's workers at nice 15
                # would get a few percent of a core beside other work, and every timing in a test with it
                _system_config={"worker_niceness": 0},
            )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _warm_ray_workers(ray: Any) -> Iterator[None]:
    """While ray.init starts an instance: its raylet's worker command runs warm_ray_worker.py, so
    each worker (a replica's process) forks from the test run's warm server with torch and
    hpcinfer imported (tests/fixtures/warm_cli.py), where a fresh interpreter spends ~2.5 s of CPU
    importing them. Ray has no public option for its worker's file: `RayParams.worker_path` is set
    as the `Node` it starts reads it; where that changes in another Ray, the workers start cold."""
    from ray._private import node as ray_node

    server, start = WarmPopen.server_path, ray_node.Node.__init__
    worker = Path(ray_node.__file__).with_name("workers") / "default_worker.py"
    if server is None or not worker.is_file():
        yield
        return
    os.environ["HPCINFER_TEST_WARM_SOCKET"], os.environ["HPCINFER_TEST_RAY_WORKER"] = server, str(worker)

    def warm_start(self: Any, ray_params: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(ray_params, "worker_path", "") is None:
            ray_params.worker_path = str(WARM_RAY_WORKER)
        start(self, ray_params, *args, **kwargs)

    ray_node.Node.__init__ = warm_start
    try:
        yield
    finally:
        ray_node.Node.__init__ = start


class DiesOnceActor(ReplicaActor):
    """Exits its process (no cleanup, as a crash or an OOM kill would) on its second unit, once per run.

    The marker file next to the output says it happened, so the restarted actor, and every other
    one, carries on normally.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker = Path(self.replica.config.output.path + ".died")

    def run(self, unit: Any) -> Any:
        if self.calls == 1 and _claim(self.marker, str(os.getpid())):
            os._exit(1)
        return super().run(unit)


def _claim(marker: Path, key: str) -> bool:
    """True for the caller whose `key` the marker holds: the first to ask writes it."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return marker.read_text() == key
    os.write(fd, key.encode())
    os.close(fd)
    return True


def _bump(counter: Path) -> int:
    """Adds one to a count kept in a file (only one replica writes it); returns the new count."""
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    return n


class _FaultyActor(ReplicaActor):
    """The replica that runs the run's first unit is the faulty one, for good (its actor id is kept);
    `arm(error)` makes its device fail from then on, `arm(None)` heals it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray

        super().__init__(*args, **kwargs)
        self.out = self.replica.config.output.path
        self.key = ray.get_runtime_context().get_actor_id()

    def faulty(self) -> bool:
        return _claim(Path(self.out + ".faulty"), self.key)

    def arm(self, error: BaseException | None, hang: threading.Event | None = None) -> None:
        def fail(*_: Any) -> None:
            if hang is not None:
                hang.wait()
            if error is not None:
                raise error

        broken = error is not None or hang is not None
        if hasattr(self.replica, "step_hook"):  # generation: an engine step
            self.replica.step_hook = fail if broken else None
        elif broken:  # embedding: the device's forward
            self.replica.devices[0].before_forward = fail
        else:
            vars(self.replica.devices[0]).pop("before_forward", None)


class LostActor(_FaultyActor):
    """The faulty replica's device is lost: every unit it runs fails."""

    def run(self, unit: Any) -> Any:
        self.arm(RuntimeError("device lost") if self.faulty() else None)
        return super().run(unit)


class FlakyActor(_FaultyActor):
    """The faulty replica fails its first two units (its breaker opens), then works again; the other
    replicas wait for it to recover, so work is left for it after its cool-down."""

    def run(self, unit: Any) -> Any:
        recovered = Path(self.out + ".recovered")
        if not self.faulty():
            for _ in range(1200):  # NOTE: 60 s at most: a broken test must not hang the suite
                if recovered.exists():
                    break
                time.sleep(0.05)
            return super().run(unit)
        failing = _bump(Path(self.out + ".failures")) <= 2
        self.arm(RuntimeError("transient fault") if failing else None)
        result = super().run(unit)
        if not failing:
            recovered.touch()
        return result


class PoisonedActor(_FaultyActor):
    """Every replica's device fails on the windows from the third on: every breaker opens."""

    def run(self, unit: Any) -> Any:
        self.arm(RuntimeError("device lost") if unit.window_id >= 2 else None)
        return super().run(unit)


class HangsActor(_FaultyActor):
    """The faulty replica's device stops answering in its first unit (until its process is killed)."""

    def run(self, unit: Any) -> Any:
        hangs = self.faulty() and _bump(Path(self.out + ".hangs")) == 1
        self.arm(None, threading.Event() if hangs else None)
        return super().run(unit)
