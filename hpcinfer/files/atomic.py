"""Crash-safe file writes: written under a temporary name, fsynced, renamed over the target, the folder fsynced.

A kill at any instruction leaves either the old file or the new one, never half of one; the
temporary's name (`.NAME.tmp-PID`) is what a later run's lock holder may remove as stale.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ..errors import OutputError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Any) -> None:
    """write(tmp_path) then fsync and rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(f"cannot write ({exc.strerror or exc})", path=str(path)) from None


__all__ = ["atomic_write", "fsync_dir"]
