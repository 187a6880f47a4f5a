"""Declarations -> click options for a command, and parsed values -> the frozen config it runs.

Each option's default is read from the config field it fills, so the two cannot drift apart, and
the config is built by walking the same declarations, so no option is named a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import click

from ..config import RunConfig
from ..tune.options import TuneOptions
from .declare import Opt, SectionOption
from .table import OPTIONS

_RUN_DEFAULTS = RunConfig()
_TUNE_DEFAULTS = TuneOptions()


def declared(command: str) -> list[Opt]:
    return [o for o in OPTIONS if command in o.commands]


def default_of(o: Opt) -> Any:
    """The option's default: the config field's own value (a `--no-X` switch is off)."""
    if o.switch:
        return False
    if o.field is None:
        return o.default
    root, *path = o.field.split(".")
    value: Any = _TUNE_DEFAULTS if root == "tune" else getattr(_RUN_DEFAULTS, root)
    for name in path:
        value = getattr(value, name)
    return list(value) if o.multiple else value


def field_choices(o: Opt) -> tuple[Any, ...] | None:
    """The choices the option's config field declares (config.choice), if any."""
    if o.field is None or o.field.startswith("tune."):
        return None
    *path, leaf = o.field.split(".")
    owner: Any = _RUN_DEFAULTS
    for name in path:
        owner = getattr(owner, name)
    meta = next((f.metadata for f in fields(owner) if f.name == leaf), {})
    return meta.get("choices")


def click_option(o: Opt, command: str) -> Callable[[Any], Any]:
    default = default_of(o)
    if default == "" or (default == () and not o.multiple):  # NOTE: an empty default would count as given
        default = None  # (and -o would never be missing; an empty tuple would parse as the text "()")
    text = o.help
    if o.default_help:
        text += f" [default: {o.default_help}]"
    kw: dict[str, Any] = {"help": text, "section": o.section, "cls": SectionOption}
    if o.switch:
        kw["is_flag"] = True
    else:
        if default is not None:  # NOTE: an explicit default=None would make a required option optional
            kw["default"] = default
        kw["show_default"] = default not in (None, []) and not o.default_help
        choices = field_choices(o) if o.type is None else None  # NOTE: written once, on the field
        kind = click.Choice([str(c) for c in choices if c is not None]) if choices else o.type
        kw.update(type=kind, multiple=o.multiple, metavar=o.metavar)
        kw["required"] = command in o.required
    return click.option(*o.flags, o.name, **kw)


def with_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a command function with INPUT... and every option declared for `command`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for o in reversed(declared(command)):  # NOTE: decorators apply bottom-up
            fn = click_option(o, command)(fn)
        return click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")(fn)

    return decorate


def build_run_config(values: dict[str, Any], command: str) -> RunConfig:
    """The run's frozen config from the parsed values of `command`'s options (others keep defaults)."""
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {"input": {"paths": tuple(values["inputs"])}}
    for o in declared(command):
        if o.field is None or o.field.startswith("tune."):
            continue
        value = values[o.name]
        if value is None or (o.switch and not value):  # not given: the field keeps its default
            continue  # NOTE: so `--normalize` and `--no-normalize` can share a field that defaults to None
        if o.negates:
            value = not value
        elif o.multiple:
            value = tuple(value)
        root, _, leaf = o.field.partition(".")
        if leaf:
            parts.setdefault(root, {})[leaf] = value
        else:
            top[root] = value
    pair = parts.get("input", {}).get("pair_columns")
    if isinstance(pair, str):  # --pair-columns A,B
        parts["input"]["pair_columns"] = tuple(name.strip() for name in pair.split(","))
    if "strict" in values:
        limit, fraction = reject_limits(values["strict"], values["max_rejects"])
        parts.setdefault("output", {}).update(max_rejects=limit, max_reject_fraction=fraction)
    sections = {name: replace(getattr(_RUN_DEFAULTS, name), **kw) for name, kw in parts.items()}
    return RunConfig(**top, **sections)


def build_tune_options(values: dict[str, Any]) -> TuneOptions:
    own = [o for o in declared("tune") if o.field is not None and o.field.startswith("tune.")]
    return TuneOptions(**{o.field.removeprefix("tune."): values[o.name] for o in own if o.field})


def reject_limits(strict: bool, raw: str | None) -> tuple[int | None, float | None]:
    """--strict -> (0, None); --max-rejects 100 -> (100, None); 0.01 or 1% -> (None, 0.01)."""
    if strict:
        return 0, None
    if raw is None:
        return None, None
    try:
        if raw.endswith("%"):
            return None, float(raw[:-1]) / 100
        value = float(raw)
    except ValueError:
        raise click.BadParameter(f"{raw!r} is neither a count nor a fraction", param_hint="--max-rejects") from None
    return (int(value), None) if value >= 1 or value == 0 else (None, value)
