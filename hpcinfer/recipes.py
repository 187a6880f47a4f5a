"""Recipes: TOML files of `run` options (`hpcinfer run --config recipe.toml`).

Keys are option names without the leading dashes (`max-batch-tokens` or `max_batch_tokens`);
flags on the command line override the file; an unknown key is an error naming the key. A `--no-X`
flag may also be written positively, `X = true|false` (`prefix-cache = false` is `no-prefix-cache = true`).
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
NOT_IN_RECIPES = {
    *("inputs", "output", "config", "resume", "overwrite"),
    *("report_path", "report_html", "metrics_port", "metrics_linger_s", "trace_path"),
}
NEGATED = "no_"


def _negated(dest: str, allowed: set[str]) -> str | None:
    """The `no_X` flag that the positive key `X` stands for, if the command has one."""
    flag = NEGATED + dest
    return flag if flag in allowed and dest not in allowed else None


def load_recipe(path: str, allowed: set[str]) -> dict[str, Any]:
    """Reads a recipe into {option dest: value}; `allowed` are the command's option dests."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read recipe ({exc.strerror})", path=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML ({exc})", path=path) from None
    flat = _flatten(data)
    values: dict[str, Any] = {}
    for key, value in flat.items():
        dest = key.replace("-", "_")
        if (flag := _negated(dest, allowed)) is not None:
            if not isinstance(value, bool):
                raise ConfigError(f"key '{key}': expected true or false, got {value!r}", path=path)
            if flag in values:
                raise ConfigError(f"keys '{key}' and '{flag.replace('_', '-')}' say the same thing twice", path=path)
            values[flag] = not value
            continue
        if dest not in allowed or dest in NOT_IN_RECIPES:
            names = allowed - NOT_IN_RECIPES
            names |= {k.removeprefix(NEGATED) for k in names if _negated(k.removeprefix(NEGATED), allowed)}
            known = ", ".join(sorted(k.replace("_", "-") for k in names))
            raise ConfigError(f"unknown key '{key}' (known: {known})", path=path)
        if dest in values:
            raise ConfigError(f"key '{key}' is given twice (or with its opposite)", path=path)
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
