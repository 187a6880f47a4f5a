"""How an option is declared: once, with its flags, help, section, commands and config field.

A declaration is the only place an option is named: its click option, its default (read from the
config field it fills) and its place in the config tree all come from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

ALL = ("run", "profile", "tune")
RUNS = ("run", "profile")  # the commands that run a job (tune runs trials of one)

SECTIONS = (
    "Input",
    "Output",
    "Model and task",
    "Embedding",
    "Generation",
    "Devices",
    "Cluster",
    "Pipeline",
    "Reports",
    "Profiling",
    "Tuning",
)


@dataclass(frozen=True, slots=True)
class Opt:
    """One command-line option.

    `field` is a dotted path into what the command builds: `plan.sort_window` is RunConfig's,
    `tune.repeats` is TuneOptions', None is the command's own (read by the command itself).
    The default is read from that field unless `default` is given; `negates` makes a `--no-X`
    switch that sets the field to False.
    """

    flags: tuple[str, ...]
    field: str | None
    help: str
    section: str
    commands: tuple[str, ...] = ALL
    type: Any = None
    switch: bool = False
    negates: bool = False
    multiple: bool = False
    metavar: str | None = None
    default: Any = None
    default_help: str | None = None  # shown as [default: ...] where the field's value says too little
    dest: str | None = None
    required: tuple[str, ...] = ()  # the commands that need it given

    @property
    def name(self) -> str:
        """The value's key in the parsed options (click's dest)."""
        if self.dest:
            return self.dest
        longest = max(self.flags, key=len)
        return longest.lstrip("-").replace("-", "_")


def opt(flags: str, field: str | None, section: str, help: str, **kw: Any) -> Opt:  # noqa: A002 - click's word
    """`opt("-o --output", "output.path", "Output", "...")`: flags separated by spaces."""
    return Opt(tuple(flags.split()), field, help, section, **kw)


class SecondsOrOff(click.ParamType):
    """A number of seconds, or `off` (read as 0)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        text = str(value).strip().lower()
        if text == "off":
            return 0.0
        try:
            return float(text)
        except ValueError:
            self.fail(f"{value!r} is neither a number of seconds nor off", param, ctx)


class SectionOption(click.Option):
    """A click option that knows its help section."""

    def __init__(self, *args: Any, section: str = "Other", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """`--help` printed in sections (Input, Output, Model and task, ...), in the order of SECTIONS."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(param, "section", "Other"), []).append(record)
        for name in (*SECTIONS, "Other"):
            if name in groups:
                with formatter.section(name):
                    formatter.write_dl(groups[name])
