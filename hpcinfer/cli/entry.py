"""The `hpcinfer` program (its console script and `python -m hpcinfer`): the command line, then the
process's end without the interpreter's teardown of every module (process_end.py). `main`
(the click group) stays a plain function for callers that run it in their own process."""

from __future__ import annotations

from typing import NoReturn

from ..process_end import run_and_end
from .commands import main


def run() -> NoReturn:
    run_and_end(main)
