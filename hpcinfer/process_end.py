"""How hpcinfer's own processes end (the `hpcinfer` program, a tensor-parallel rank): as the
interpreter ends one, less the teardown.

NOTE: a process's non-daemon threads joined (and what waits on that, as concurrent.futures'
workers), its atexit handlers run (Ray's shutdown, logging's flush, temporary folders' cleanup),
stdout and stderr flushed; then `os._exit` with the program's status. What is left out is freeing
every module's objects one by one (torch's, transformers', pyarrow's...), which took 0.4-0.9 s of a
small embedding run's 2.4-3.7 s (benchmarks/speed/bench_cli_exit.py) and which nothing of a run
needs: its outputs are committed and closed before it returns. Under a tracer or profiler (a
debugger, `python -m cProfile`), whose report comes after the program returns, the interpreter ends
the process itself.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def run_and_end(program: Callable[[], object]) -> NoReturn:
    """Runs `program` (a command line's main), then ends the process with its status."""
    try:
        program()
        code = 0
    except SystemExit as stop:
        code = exit_status(stop.code)
    end_process(code)


def exit_status(code: object) -> int:
    """The status `raise SystemExit(code)` ends a Python process with: None 0, an int itself, anything
    else printed to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def end_process(code: int, by_signal: int | None = None) -> NoReturn:
    """Ends the process with status `code`, or killed by `by_signal` (as an uncaught
    KeyboardInterrupt ends one, by SIGINT), after the steps of the interpreter's own end."""
    shutdown = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit_handlers is None or (by_signal is None and (sys.gettrace() or sys.getprofile())):
        sys.exit(code)
    shutdown()  # NOTE: what the interpreter's own end runs first (multiprocessing's children call it too)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:  # noqa: BLE001 (as the interpreter's end: a failed flush exits 120)
            code = 120
    if by_signal is not None:
        signal.signal(by_signal, signal.SIG_DFL)
        os.kill(os.getpid(), by_signal)
    os._exit(code)
