"""One run per output: an exclusive lock file in the output's parts directory, held for the whole run.

NOTE: an advisory `flock` on OUT.parts/.lock. The kernel releases it when the holder exits, however
it exits (kill -9 included), so a lock left by a crashed run is stale by construction and the next
run simply takes it. The holder writes its pid, host and start time into the file, so a refused
run can say which process holds the output.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..errors import OutputError

LOCK_NAME = ".lock"


class OutputLock:
    """acquire() takes the lock or raises OutputError naming the holder; release() lets it go."""

    def __init__(self, parts: Path, output: str) -> None:
        self.parts = parts
        self.output = output
        self.path = parts / LOCK_NAME
        self.created_dir = False  # the parts directory did not exist before this run
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        self.created_dir = not self.parts.exists()
        try:
            self.parts.mkdir(exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot create the lock file ({exc.strerror})", path=str(self.path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise OutputError(
                f"another hpcinfer run ({holder}) is writing this output; wait for it to end or stop it",
                path=self.output,
            ) from None
        self._fd = fd
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "a process that is starting"
    where = f" on {holder['host']}" if holder.get("host") and holder["host"] != socket.gethostname() else ""
    since = f", started {holder['started']}" if holder.get("started") else ""
    return f"pid {holder['pid']}{where}{since}"
