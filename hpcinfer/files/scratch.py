"""Scratch folders in the temporary folder, and the sweep of those a killed run left behind.

A run's scratch (an object-store part before its upload, `tune`'s sample, `profile`'s output, the
tensor-parallel ranks' logs and figures) is removed when the run is done with it, unless its
process dies first without cleaning up (`kill -9`, the OOM killer, a second Ctrl-C), which is when
users reach for `--resume`. So each scratch folder holds a lock file, `.held`: an advisory `flock`,
as on the output's own lock (lock.py), which the kernel drops however the process ends. Every run
sweeps its temporary folder once, removing the scratch folders whose lock nobody holds: a killed
job's part file (a whole window of rows) does not stay in `$TMPDIR` for good.

A lock, not a process id, says a folder is in use: a pid means nothing to a run on another host
sharing `$TMPDIR` (a cluster's scratch filesystem) or in another container sharing the volume.
Where the filesystem takes no `flock`, a folder holds no lock and is never swept.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile

HELD = ".held"
KINDS = ("part", "tune", "profile", "tp")
# NOTE: the whole name, as tempfile.mkdtemp makes it (8 characters of [a-z0-9_] after the prefix),
# so a folder of the user's own called hpcinfer-part-something is never taken for a scratch folder
_NAME = re.compile(rf"hpcinfer-(?:{'|'.join(KINDS)})-[a-z0-9_]{{8}}")
_swept: set[str] = set()  # the temporary folders this process has swept ($TMPDIR may change)


class ScratchDir:
    """A scratch folder `hpcinfer-<kind>-` plus tempfile's 8 random characters, in the temporary
    folder, held until `cleanup()` (or the end of its `with` block, which yields its path) removes it."""

    def __init__(self, kind: str) -> None:
        assert kind in KINDS, kind
        sweep_once()
        self.name = tempfile.mkdtemp(prefix=f"hpcinfer-{kind}-")
        self._fd = _hold(self.name)

    def cleanup(self) -> None:
        shutil.rmtree(self.name, ignore_errors=True)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def sweep_once() -> None:
    """Sweeps the temporary folder, once per process (and again if `$TMPDIR` moves)."""
    folder = tempfile.gettempdir()
    if folder not in _swept:
        _swept.add(folder)
        sweep(folder)


def sweep(folder: str) -> list[str]:
    """Removes this user's scratch folders in `folder` whose lock nobody holds; their names."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if not _NAME.fullmatch(entry.name):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, HELD), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # NOTE: no lock file: a folder being made, or one that cannot be locked
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # NOTE: held (in use), or a lock this filesystem cannot take: left alone
            os.close(fd)
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        os.close(fd)
        removed.append(entry.name)
    return removed


def _hold(folder: str) -> int | None:
    """Locks the folder's lock file; its descriptor, or None where the filesystem takes no flock."""
    making = os.path.join(folder, HELD + ".new")
    try:
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(making, os.path.join(folder, HELD))  # NOTE: a sweep sees `.held` only once it is locked
    except OSError:
        os.close(fd)
        return None
    return fd
