"""`python tests/integration/crash_serve.py POINT serve ARGS...`: `hpcinfer serve ARGS...` that SIGKILLs itself
the first time its batch runner reaches POINT (a real kill -9: no cleanup, no atexit).

Points: validating (the batch's file is being checked), job_done (the job has written its whole output; the
state still says in_progress), files_renamed (the output and error files are in place; no row of the state names
them yet), ending (the transaction that registers them and ends the batch is about to commit).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from hpcinfer.cli import main
from hpcinfer.serve import runner, state

POINT = sys.argv.pop(1)


def die() -> None:
    if threading.current_thread().name != "hpcinfer-batches":
        return  # NOTE: the points are the batch runner's (an upload also syncs its folder)
    time.sleep(1.0)  # NOTE: the runner may reach the point before the create request's answer has left
    os.kill(os.getpid(), signal.SIGKILL)


def patch(module: Any, name: str, point: str) -> None:
    real = getattr(module, name)

    def reached(*args: Any, **kwargs: Any) -> Any:
        if point == POINT:
            die()
        return real(*args, **kwargs)

    setattr(module, name, reached)


patch(runner, "check_batch_file", "validating")
patch(runner, "fsync_dir", "files_renamed")
_move = state.State.move


def _moving(self: state.State, batch_id: str, sources: tuple[str, ...], status: str, *args: Any, **kw: Any) -> Any:
    if (POINT, status) in (("job_done", "finalizing"), ("ending", "completed")):
        die()
    return _move(self, batch_id, sources, status, *args, **kw)


state.State.move = _moving  # type: ignore[method-assign]

sys.argv[0] = "hpcinfer"
main()
