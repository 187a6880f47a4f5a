"""The tuning table, log line and verdict of embedding trials (`hpcinfer tune`)."""

from __future__ import annotations

from rich.table import Table

from ..tune.render import gain_line, params_line, trials_table
from ..tune.search import Search, Trial


def table(search: Search, status: str = "") -> Table:
    """Embedding trials: rows/s, tokens/s, p99 latency (per batch, or per request under --rate), memory."""
    p99 = "p99 request ms" if search.goal.objective == "latency" or search.space.timeouts_ms else "p99 batch ms"
    figures = [
        ("rows/s", lambda t: f"{t.rows_per_s:,.1f}"),
        ("tokens/s", lambda t: f"{t.tokens_per_s:,.0f}"),
        (p99, lambda t: f"{t.p99_ms:,.1f}"),
        ("memory MiB", lambda t: f"{t.memory_bytes / 2**20:,.0f}"),
    ]
    return trials_table(search, "hpcinfer tune", status, figures)


def line(search: Search, trial: Trial) -> str:
    """One finished trial, for a log (no live table)."""
    return (
        f"trial {trial.index}: {params_line(trial)}: {trial.rows_per_s:,.1f} rows/s, p99 {trial.p99_ms:,.1f} ms, "
        f"{trial.memory_bytes / 2**20:,.0f} MiB{gain_line(trial)}"
    )


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
