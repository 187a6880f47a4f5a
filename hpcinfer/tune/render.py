"""What every task's tuning view shares, and the dispatch to the task's own (`search.view`).

A task's search carries its view (tasks/<task>/tune_view.py: `table`, `line`, `verdict`); the
command line asks for a table, a log line or the verdict here without knowing the task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.table import Table

from .search import Goal, Search, Trial

HEADERS = {
    "max_batch_tokens": "tokens",
    "max_batch_size": "rows",
    "streams": "streams",
    "staging_buffers": "buffers",
    "batch_timeout_ms": "timeout ms",
    "max_num_batched_tokens": "step tokens",
    "max_num_seqs": "seqs",
    "prefix_cache": "prefix",
}


def shown_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def status_words(t: Trial, chosen: bool, goal: Goal) -> str:
    words = []
    if chosen:
        words.append("best")
    if t.status != "ok":
        words.append(t.status)
    if t.saturated:
        words.append("saturated")
    if t.note:
        words.append(t.note)
    return "; ".join(words) or ("" if t.index else "default")


def params_line(trial: Trial) -> str:
    return " ".join(f"{k.replace('_', '-')}={shown_value(v)}" for k, v in trial.params.items())


def gain_line(trial: Trial) -> str:
    """The trial's gain over the default and, if any, its status and note, for a log line."""
    gain = "" if trial.gain is None else f" {trial.gain:.2f}x default"
    extra = f" [{trial.status}{': ' + trial.note if trial.note else ''}]" if trial.status != "ok" or trial.note else ""
    return gain + extra


def trials_table(search: Search, title: str, status: str, figures: list[tuple[str, Callable[[Trial], str]]]) -> Table:
    """Every trial of a search, a row each: its knobs, the task's `figures` (column, text of a
    trial), its gain over the default and its status; the best in bold."""
    table = Table(title=title, title_justify="left", caption=status or None, caption_justify="left")
    knobs = list(search.trials[0].params) if search.trials else []
    for col in ["#", *(HEADERS[k] for k in knobs), *(name for name, _ in figures), "vs default", "status"]:
        table.add_column(col, justify="left" if col == "status" else "right")
    for t in search.trials:
        chosen = t is search.best
        table.add_row(
            str(t.index),
            *(shown_value(t.params[k]) for k in knobs),
            *(show(t) for _, show in figures),
            "" if t.gain is None else f"{t.gain:.2f}x",
            status_words(t, chosen, search.goal),
            style="bold green" if chosen else ("dim" if t.status != "ok" else None),
        )
    return table


def trial_table(search: Search, status: str = "") -> Table:
    return search.view.table(search, status)


def trial_line(search: Search, trial: Trial) -> str:
    return search.view.line(search, trial)


def verdict(search: Search) -> list[str]:
    return search.view.verdict(search)
