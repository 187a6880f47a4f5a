"""Starts the server: checks what it is asked to bind and serve, settles its API keys, opens the
state (clearing what a killed server left half-written), starts the batch queue and uvicorn, and on
Ctrl-C stops the running batch between work items (it is resumed by the next start).

With no key given, the server makes one and keeps it in `DATA_DIR/api-key` (readable by its user
only), as Jupyter makes a token: on a shared machine every local user could otherwise read every
batch. `--no-auth` is the explicit choice of an open server, on a loopback address only."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from ..models.shelf import ModelShelf
from ..registry import pick_task, task_named
from .app import ServeSettings, build_app
from .runner import BatchRunner
from .state import FINAL, State

KEY_FILE = "api-key"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


@dataclass(frozen=True, slots=True)
class Limits:
    max_file_bytes: int  # per upload
    max_requests: int  # per batch
    max_key_bytes: int  # what one key's files hold in all (0: no quota)


@dataclass(frozen=True, slots=True)
class Access:
    api_keys: tuple[str, ...]  # given (--api-key); none: one made and kept in the data folder
    no_auth: bool  # --no-auth: an open server (loopback only)
    allowed_hosts: tuple[str, ...] = ()  # Host names taken besides the bound address (a DNS name of it)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    base: RunConfig, host: str, port: int, data_dir: Path, access: Access, limits: Limits, keep_models: int
) -> None:
    """Serves until interrupted. Each API key's files and batches are its own; `keep_models`: models
    kept loaded between batches (0: loaded for every batch)."""
    if access.no_auth and access.api_keys:
        raise ConfigError("--no-auth and --api-key contradict each other: choose one")
    if access.no_auth and not is_loopback(host):
        raise ConfigError(f"--host {host} is reachable from other machines: --no-auth is for a loopback address only")
    task = task_named(pick_task(base))
    if not getattr(task, "endpoints", ()):
        raise ConfigError(
            f"--task {task.name} answers no OpenAI batch endpoint; serve a model that embeds, scores or generates"
        )
    import uvicorn  # NOTE: the serve extra: imported only here

    os.umask(0o077)  # NOTE: uploads, answers and the state are the keys' own: not readable by other users
    data_dir = data_dir.resolve()  # NOTE: a restart from another folder finds the same batches
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = open(data_dir / ".lock", "a+")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ConfigError(f"another hpcinfer serve uses {data_dir}: one server per --data-dir") from None
    keys = access.api_keys or (() if access.no_auth else (kept_key(data_dir / KEY_FILE),))
    state = State(data_dir)
    sweep(data_dir, state)
    settings = ServeSettings(
        data_dir, base.model, task.endpoints, keys, limits.max_file_bytes, limits.max_requests, limits.max_key_bytes,
        taken_hosts(host, access.allowed_hosts),
    )  # fmt: skip
    runner = BatchRunner(state, data_dir, base, limits.max_requests, ModelShelf(keep_models))
    app = build_app(settings, state, runner)
    runner.start()
    served = ", ".join(task.endpoints)
    print(f"hpcinfer serve: {task.name} ({served}) on http://{host}:{port}/v1, state in {data_dir}", file=sys.stderr)
    if access.no_auth:
        print("hpcinfer serve: --no-auth: every user of this machine can read and run every batch", file=sys.stderr)
    elif not access.api_keys:
        key_file = data_dir / KEY_FILE
        print(f"hpcinfer serve: API key in {key_file} (yours only); clients send it as a Bearer token, e.g. "
              f"export OPENAI_API_KEY=$(cat {key_file})", file=sys.stderr)  # fmt: skip
    try:
        # NOTE: no lifespan events are used; with them uvicorn logs a cancelled lifespan task on Ctrl-C
        uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="off")
    except KeyboardInterrupt:
        pass  # NOTE: uvicorn raises the Ctrl-C it caught again once it has stopped serving: a normal end
    finally:
        runner.close()
        state.close()


def kept_key(path: Path) -> str:
    """The server's own API key: the one in `path`, or a new random one written there (mode 0600)."""
    try:
        key = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        key = ""
    if key:
        return key
    key = "hpc-" + secrets.token_urlsafe(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(key + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    return key


def taken_hosts(host: str, allowed: tuple[str, ...]) -> frozenset[str] | None:
    """The Host header names the server answers: the bound address and the names it is known by;
    None for a server bound to every address (any name may reach it; a key is required there)."""
    if host in ("0.0.0.0", "::", ""):
        return None
    bound = f"[{host}]" if ":" in host else host
    names = {bound.lower(), *(a.lower() for a in allowed)}
    if is_loopback(host):
        names |= LOOPBACK_NAMES
    else:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(names)


def sweep(data_dir: Path, state: State) -> None:
    """What a killed server left half-written: uploads and produced files that no row of the state
    names (`.upload`, `.tmp`, a file renamed before its row was written) and the job folders of
    batches that have ended."""
    files = data_dir / "files"
    if files.is_dir():
        known = state.file_ids()
        for path in files.iterdir():
            if path.suffix in (".upload", ".tmp") or (path.suffix == ".jsonl" and path.stem not in known):
                path.unlink(missing_ok=True)
    batches = data_dir / "batches"
    if batches.is_dir():
        for folder in batches.iterdir():
            row = state.batch(folder.name)
            if row is None or row.status in FINAL:
                shutil.rmtree(folder, ignore_errors=True)
