"""One run per output on an object store: a lease object, created only where none is, renewed while the run runs.

A store has no `flock`, and nothing releases a lock when its holder dies. So the lock is an object
holding who took it and until when (`expires`, the holder's clock plus the lease time). A run
takes it by creating it only if absent (a conditional put); one that finds it refuses to start
unless it is stale: expired (the holder stopped renewing it), or held by a process of this very
host that is no longer alive (a `kill -9` resumed on the same machine need not wait out the
lease). The holder renews it every third of the lease time and deletes it when the run ends.

Should two runs ever both believe they hold it (a holder paused for longer than its lease), the
manifest's conditional put stops the second at its first commit (object_folder.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..errors import OutputError
from . import storage

LEASE_NAME = "_lease.json"


class Lease:
    def __init__(self, fs: Any, key: str, output: str, lease_s: float) -> None:
        self.fs = fs
        self.key = key
        self.output = output
        self.lease_s = lease_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False  # another run took the lease while this one ran

    def _body(self) -> bytes:
        holder = {
            "token": self.token,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "expires": time.time() + self.lease_s,
        }
        return json.dumps(holder).encode()

    def _fail(self, what: str, exc: BaseException) -> OutputError:
        return OutputError(f"cannot {what} ({storage.failure(exc)})", path=storage.shown(self.output))

    def acquire(self) -> Lease:
        for _ in range(3):  # NOTE: a lease deleted between our create and our read: try again
            try:
                self.fs.pipe_file(self.key, self._body(), mode="create")
                break
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue
                if holder.get("token") == self.token:
                    break  # NOTE: our own put, retried after its answer was lost
                if not _stale(holder):
                    raise OutputError(
                        f"another hpcinfer run ({_describe(holder)}) is writing this output; wait for it to end "
                        "or stop it",
                        path=storage.shown(self.output),
                    ) from None
                self._remove_stale()
            except storage.errors() as exc:
                raise self._fail("take the output's lease", exc) from None
        else:
            raise OutputError(
                "cannot take the output's lease: it keeps changing hands", path=storage.shown(self.output)
            )
        self._renewer = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._renewer.start()
        return self

    def _remove_stale(self) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            pass
        except storage.errors() as exc:
            raise self._fail("remove a stale lease", exc) from None

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.fs.cat_file(self.key))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # NOTE: not a lease any run of ours wrote: stale (see _stale)
        except storage.errors() as exc:
            raise self._fail("read the output's lease", exc) from None
        return data if isinstance(data, dict) else {}

    def _renew(self) -> None:
        """Renews the lease while it is still ours; a lease another run took is left to it (the
        manifest's conditional put stops this run at its next commit)."""
        while not self._stop.wait(self.lease_s / 3):
            try:
                holder = self._read()
                if holder is not None and holder.get("token") != self.token:
                    self.lost = True
                    return
                self.fs.pipe_file(self.key, self._body())
            except (OutputError, *storage.errors()):  # NOTE: a missed renewal is retried; the lease
                continue  # has two more thirds to run

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=self.lease_s)  # NOTE: a renewal stuck on the store must not hang the exit
            self._renewer = None
            with contextlib.suppress(OutputError, *storage.errors()):
                holder = self._read()
                if holder is not None and holder.get("token") == self.token:
                    self.fs.rm_file(self.key)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _stale(holder: dict[str, Any]) -> bool:
    expires = holder.get("expires")
    if not isinstance(expires, (int, float)):
        return True  # NOTE: unreadable: no run of ours wrote it
    if time.time() > expires:
        return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return not _alive(holder["pid"])
    return False


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def _describe(holder: dict[str, Any]) -> str:
    where = f" on {holder['host']}" if holder.get("host") and holder["host"] != socket.gethostname() else ""
    left = holder["expires"] - time.time()
    return f"pid {holder.get('pid')}{where}, started {holder.get('started')}, lease {left:.0f} s left"


__all__ = ["LEASE_NAME", "Lease"]
