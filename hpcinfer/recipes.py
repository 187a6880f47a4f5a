"""Recipes: TOML files of `run` options (`hpcinfer run --config recipe.toml`).

Keys are option names without the leading dashes (`max-batch-tokens` or `max_batch_tokens`);
flags on the command line override the file; an unknown key is an error naming the key.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Options that name files for one job, not a way of running: never taken from a recipe.
NOT_IN_RECIPES = {"inputs", "output", "config", "resume", "overwrite", "report_path", "trace_path"}


def load_recipe(path: str, allowed: set[str]) -> dict[str, Any]:
    """Reads a recipe into {option dest: value}; `allowed` are the command's option dests."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read recipe ({exc.strerror})", path=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML ({exc})", path=path) from None
    flat = _flatten(data)
    values = {}
    for key, value in flat.items():
        dest = key.replace("-", "_")
        if dest not in allowed or dest in NOT_IN_RECIPES:
            known = ", ".join(sorted(k.replace("_", "-") for k in allowed - NOT_IN_RECIPES))
            raise ConfigError(f"unknown key '{key}' (known: {known})", path=path)
        values[dest] = value
    return values


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    """A [run] table is optional: `[run] streams = 2` and top-level `streams = 2` are the same."""
    flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
    for table, values in data.items():
        if isinstance(values, dict):
            if table != "run":
                raise ConfigError(f"unknown table [{table}] (only [run] is known)")
            flat.update(values)
    return flat


def dump_recipe(values: dict[str, Any], comment: str) -> str:
    """A recipe file for these option values, with a comment on when to use it."""
    lines = [f"# {line}" for line in comment.splitlines()] + ["", "[run]"]
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            text = str(value)
        lines.append(f"{key.replace('_', '-')} = {text}")
    return "\n".join(lines) + "\n"
