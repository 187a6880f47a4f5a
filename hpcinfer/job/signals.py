"""Ctrl-C and SIGTERM: the first one stops the run between work items, a second one exits at once."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def signals_stop(stop: threading.Event) -> Iterator[list[int]]:
    """First SIGINT/SIGTERM sets `stop` (committed windows stay); a second one exits at once.

    Yields the list of signals received, empty when the run was not interrupted; 0 in it when its
    caller set `stop` (a server cancelling a batch). Off the main thread (a Ray actor, a test's
    worker, a server's batch runner) signals cannot be caught, and nothing is installed.
    """
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        if stop.is_set():  # NOTE: a failure raises before this; a stop without one is the caller's
            got.append(0)
        return

    def handler(signum: int, _frame: Any) -> None:
        if got:
            os._exit(128 + signum)  # committed parts are valid: every one was renamed into place whole
        got.append(signum)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
        if stop.is_set() and not got:
            got.append(0)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
