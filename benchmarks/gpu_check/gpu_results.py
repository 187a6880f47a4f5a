"""What the GPU check's scripts share: a deadline, results on disk after every measurement, and a
failing measurement recorded while the others go on.

- `--deadline S` (`add_deadline`, `Deadline`): no new measurement starts S seconds or more after
  the script started; the one running finishes (the shell's `timeout -k` is the hard stop).
- `write_json`: a temporary file beside the target, then a rename, so a kill never leaves half a
  file; each script rewrites its whole result file after every measurement, and marks the one it
  is about to start as running, so a kill shows which one it was.
- `attempt`: a measurement's result, or an entry saying it errored (with the error) or was
  skipped past the deadline.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
STARTED = time.monotonic()  # NOTE: when this module was imported, at the top of every script


class Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else STARTED + seconds

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def left(self) -> float:
        return math.inf if self.at is None else self.at - time.monotonic()


def add_deadline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="S",
        help="start no new measurement S seconds after this script started (the running one finishes)",
    )


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON at `path`, atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def attempt(name: str, fn: Callable[[], T], deadline: Deadline) -> tuple[T | None, dict[str, Any] | None]:
    """(fn(), None); or (None, {"status": "skipped" | "error", ...}) when the deadline has passed or
    fn raised (the traceback printed). After an error the device's cached memory is released, so
    the next measurement starts from what is really in use."""
    if deadline.passed():
        print(f"{name}: skipped (past the --deadline)", flush=True)
        return None, {"status": "skipped", "reason": "past the --deadline"}
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - recorded; the other measurements go on
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
        print(f"{name}: FAILED ({error})", flush=True)
    free_device_memory()  # NOTE: out of the except block: the traceback's frames hold the tensors
    return None, {"status": "error", "error": error[:2000]}


def free_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
