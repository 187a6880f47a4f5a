"""Scratch folders in the temporary folder, and the sweep of those a killed run left behind.

A run's scratch (an object-store part before its upload, `tune`'s sample, `profile`'s output, the
tensor-parallel ranks' logs and figures) is removed when the run ends, however it ends, except by
a kill no process outlives (`kill -9`, the OOM killer), which is when users reach for `--resume`.
Each folder's name carries its process id (`hpcinfer-part-12345-k2j4x9`), so the first scratch
folder a later run makes removes those whose process no longer runs: a killed job's part file (a
whole window of rows) does not stay in the temporary folder for good.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

_NAME = re.compile(r"hpcinfer-[a-z]+-(\d+)-")
_swept: set[str] = set()  # the temporary folders this process has swept (TMPDIR may change)


def scratch_dir(kind: str) -> tempfile.TemporaryDirectory[str]:
    """A scratch folder `hpcinfer-<kind>-<pid>-...`, removed when its block ends."""
    _sweep_once()
    return tempfile.TemporaryDirectory(prefix=f"hpcinfer-{kind}-{os.getpid()}-")


def make_scratch_dir(kind: str) -> str:
    """The same, for a folder its maker removes itself (it outlives any one block)."""
    _sweep_once()
    return tempfile.mkdtemp(prefix=f"hpcinfer-{kind}-{os.getpid()}-")


def sweep(folder: str) -> list[str]:
    """Removes this user's scratch folders in `folder` whose process no longer runs; their names."""
    if os.name != "posix":  # NOTE: os.kill(pid, 0) is a liveness probe only on POSIX (Windows ends the process)
        return []
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        found = _NAME.match(entry.name)
        if found is None or _running(int(found.group(1))):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _sweep_once() -> None:
    folder = tempfile.gettempdir()
    if folder not in _swept:
        _swept.add(folder)
        sweep(folder)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # NOTE: another user's process (EPERM) runs; anything else: assume it does
        return True
    return True
