"""Starts the server: checks what it is asked to bind and serve, opens the state, starts the batch
queue and uvicorn, and on Ctrl-C stops the running batch between work items (it is resumed by the
next start)."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import sys
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from ..registry import pick_task, task_named
from .app import ServeSettings, build_app
from .runner import BatchRunner
from .state import State


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    base: RunConfig, host: str, port: int, data_dir: Path, api_keys: tuple[str, ...], limits: tuple[int, int]
) -> None:
    """Serves until interrupted; `api_keys`: the keys it takes (each one's files and batches its own);
    `limits`: (most bytes per uploaded file, most requests per batch)."""
    if not is_loopback(host) and not api_keys:
        raise ConfigError(f"--host {host} is reachable from other machines: set --api-key (or HPCINFER_API_KEY)")
    task = task_named(pick_task(base))
    if not getattr(task, "endpoints", ()):
        raise ConfigError(
            f"--task {task.name} answers no OpenAI batch endpoint; serve a model that embeds, scores or generates"
        )
    if base.cluster.engine == "ray":
        raise ConfigError("hpcinfer serve runs batches on this machine's devices: drop engine = ray from the recipe")
    import uvicorn  # NOTE: the serve extra: imported only here

    os.umask(0o077)  # NOTE: uploads, answers and the state are the keys' own: not readable by other users
    data_dir = data_dir.resolve()  # NOTE: a restart from another folder finds the same batches
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = open(data_dir / ".lock", "a+")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ConfigError(f"another hpcinfer serve uses {data_dir}: one server per --data-dir") from None
    state = State(data_dir)
    settings = ServeSettings(data_dir, base.model, task.endpoints, api_keys, *limits)
    runner = BatchRunner(state, data_dir, base, limits[1])
    app = build_app(settings, state, runner)
    runner.start()
    served = ", ".join(task.endpoints)
    print(f"hpcinfer serve: {task.name} ({served}) on http://{host}:{port}/v1, state in {data_dir}", file=sys.stderr)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        runner.close()
        state.close()
