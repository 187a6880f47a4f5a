"""The command line: parse -> config -> api call -> render. Data on files, humans on stderr.

NOTE: only click and the light config modules are imported here; torch, pyarrow and rich are
imported by the command that needs them, so --help, --version and argument errors answer at once.

    declare.py  how an option is declared (flags, help, section, commands, config field)
    table.py    every option, declared once
    options.py  declarations -> click options; parsed values -> the frozen config
    commands.py run, profile, tune
    entry.py    the `hpcinfer` program: the command line, then the process's end without its teardown
"""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
