"""`python tests/integration/crash_run.py POINT N ARGS...`: `hpcinfer run ARGS...` that SIGKILLs itself at the
N-th time it reaches POINT on the commit path (a real kill -9: no cleanup, no atexit).

Points: parts_dir_created (the output's parts directory and lock exist, nothing else),
part_written (a part is written and fsynced under its temporary name, not yet renamed),
part_renamed (a part is in place, the manifest does not list it yet), manifest_renamed (a new
manifest is in place), assembling (the final output is half written under its temporary name),
output_renamed (the final output is in place; the rejects file and cleanup are still to come).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from hpcinfer.cli import main
from hpcinfer.files import lock
from hpcinfer.files import parts as output

POINT, NTH, ARGS = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
_hits = [0]


def _reached(point: str) -> None:
    if point != POINT:
        return
    _hits[0] += 1
    if _hits[0] == NTH:
        os.kill(os.getpid(), signal.SIGKILL)


_real_replace = os.replace


def _replace(src: str | Path, dst: str | Path) -> None:
    name = Path(dst).name
    if name.startswith("part-"):
        _reached("part_written")
    _real_replace(src, dst)
    if name.startswith("part-"):
        _reached("part_renamed")
    elif name == "manifest.json":
        _reached("manifest_renamed")
    elif not Path(dst).parent.name.endswith(".parts") and not name.endswith(".rejects.jsonl"):
        _reached("output_renamed")


_real_acquire = lock.OutputLock.acquire


def _acquire(self: lock.OutputLock) -> lock.OutputLock:
    taken = _real_acquire(self)
    _reached("parts_dir_created")
    return taken


_real_concat = output.PartStore._concat_parts


def _concat(self: output.PartStore, tmp: Path) -> None:
    if POINT == "assembling":
        tmp.write_bytes(b"PAR1 half an output")
    _reached("assembling")
    _real_concat(self, tmp)


os.replace = _replace
lock.OutputLock.acquire = _acquire
output.PartStore._concat_parts = _concat
sys.argv = ["hpcinfer", "run", *ARGS]
main()
