"""User errors on the command line: one line on stderr and an exit code, never a traceback."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from ..errors import HpcinferError, Interrupted, StageError
from ..registry import IgnoredOptions


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Renders typed errors as one line on stderr with their exit code; an interrupted run also
    prints the command that resumes it."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except IgnoredOptions as exc:  # NOTE: named as typed: `--no-overlap`, not the field's name
            click.echo(f"hpcinfer: error: {exc.message(flag_for)}", err=True)
            sys.exit(exc.exit_code)
        except Interrupted as exc:
            argv = [a for a in sys.argv[1:] if a != "--resume"]
            click.echo(f"hpcinfer: {exc}", err=True)
            click.echo(f"hpcinfer: resume with: {shlex.join(['hpcinfer', *argv, '--resume'])}", err=True)
            sys.exit(exc.exit_code)
        except (HpcinferError, StageError) as exc:
            click.echo(f"hpcinfer: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("hpcinfer: interrupted", err=True)
            sys.exit(130)

    return wrapper


def flag_for(field: str, value: Any) -> str:
    """The command-line flag that sets config `field` to `value` (`--no-overlap` for overlap=False)."""
    from .table import OPTIONS

    declared = [o for o in OPTIONS if o.field == field]
    chosen = next((o for o in declared if o.negates == (value is False)), declared[0] if declared else None)
    if chosen is None:
        return field
    return next((f for f in chosen.flags if f.startswith("--")), chosen.flags[0])
