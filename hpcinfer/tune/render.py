"""The tuning table (live while trials run) and the closing verdict."""

from __future__ import annotations

from rich.table import Table

from .search import Goal, Search, Trial

_HEADERS = {
    "max_batch_tokens": "tokens",
    "max_batch_size": "rows",
    "streams": "streams",
    "staging_buffers": "buffers",
    "batch_timeout_ms": "timeout ms",
}


def trial_table(search: Search, status: str = "") -> Table:
    goal = search.goal
    p99 = "p99 request ms" if goal.objective == "latency" or search.space.timeouts_ms else "p99 batch ms"
    table = Table(title="hpcinfer tune", title_justify="left", caption=status or None, caption_justify="left")
    knobs = list(search.trials[0].params) if search.trials else []
    for col in ["#", *(_HEADERS[k] for k in knobs), "rows/s", "tokens/s", p99, "memory MiB", "vs default", "status"]:
        table.add_column(col, justify="left" if col == "status" else "right")
    for t in search.trials:
        chosen = t is search.best
        table.add_row(
            str(t.index),
            *(f"{t.params[k]:g}" if isinstance(t.params[k], float) else str(t.params[k]) for k in knobs),
            f"{t.rows_per_s:,.1f}",
            f"{t.tokens_per_s:,.0f}",
            f"{t.p99_ms:,.1f}",
            f"{t.memory_bytes / 2**20:,.0f}",
            "" if t.gain is None else f"{t.gain:.2f}x",
            _status(t, chosen, goal),
            style="bold green" if chosen else ("dim" if t.status != "ok" else None),
        )
    return table


def _status(t: Trial, chosen: bool, goal: Goal) -> str:
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


def verdict(search: Search) -> list[str]:
    best, default, goal = search.best, search.default, search.goal
    assert best is not None and default is not None
    lines = []
    if best is default:
        lines.append(
            f"best: the default configuration; nothing beat it by {goal.min_gain:.0%} or more "
            "(smaller differences are within run-to-run noise)"
        )
    else:
        changes = ", ".join(
            f"--{k.replace('_', '-')} {best.params[k]:g}" for k in best.params if best.params[k] != default.params[k]
        )
        margin = f"{best.gain:.2f}x the default" if best.gain is not None else "the default broke a limit"
        lines.append(f"best: {changes} ({margin})")
    if goal.objective == "latency":
        lines.append(f"p99 request latency {best.p99_ms:,.1f} ms at {best.rows_per_s:,.1f} rows/s")
    else:
        lines.append(f"{best.rows_per_s:,.1f} rows/s, {best.tokens_per_s:,.0f} tokens/s, p99 {best.p99_ms:,.1f} ms")
    for skipped in search.space.skipped:
        lines.append(f"not swept: {skipped}")
    return lines
