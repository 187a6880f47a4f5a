"""The tuning table, log line and verdict of generation trials (`hpcinfer tune` on a causal LM)."""

from __future__ import annotations

from rich.table import Table

from ...tune.render import gain_line, params_line, trials_table
from ...tune.search import Trial
from .tune_search import GenerationSearch, prefix_line


def table(search: GenerationSearch, status: str = "") -> Table:
    """Generation trials: generated tokens/s first, then rows/s, TTFT and TPOT (p50), the repeat spread."""
    figures = [
        ("gen tok/s", lambda t: f"{t.tokens_per_s:,.1f}"),
        ("rows/s", lambda t: f"{t.rows_per_s:,.2f}"),
        ("TTFT ms", lambda t: f"{t.ttft_ms:,.1f}"),
        ("TPOT ms", lambda t: f"{t.tpot_ms:,.2f}"),
        ("spread", lambda t: f"{t.spread:.0%}" if t.repeats > 1 else "-"),
        ("hits", lambda t: f"{t.cached_share:.0%}"),
        ("MiB", lambda t: f"{t.memory_bytes / 2**20:,.0f}"),
    ]
    title = "hpcinfer tune (TTFT, TPOT: p50; hits: prompt tokens served by the prefix cache)"
    return trials_table(search, title, status, figures)


def line(search: GenerationSearch, trial: Trial) -> str:
    """One finished trial, for a log (no live table)."""
    return (
        f"trial {trial.index} (of at most {search.space.most_trials}): {params_line(trial)}: "
        f"{trial.tokens_per_s:,.1f} generated tokens/s, {trial.rows_per_s:,.2f} rows/s, "
        f"TTFT p50 {trial.ttft_ms:,.1f} ms, TPOT p50 {trial.tpot_ms:,.2f} ms, "
        f"spread {trial.spread:.0%}{gain_line(trial)}"
    )


def verdict(search: GenerationSearch) -> list[str]:
    best, default, goal = search.best, search.default, search.goal
    assert best is not None and default is not None
    if best is default:
        lines = [f"best: the default configuration; nothing beat it in every repeat by {goal.min_gain:.0%} or more"]
    else:
        changes = ", ".join(
            f"--{k.replace('_', '-')} {best.params[k]}" if k != "prefix_cache" else "--no-prefix-cache"
            for k in best.params
            if best.params[k] != default.params[k]
        )
        margin = f"{best.gain:.2f}x the default" if best.gain is not None else "the default broke a limit"
        lines = [f"best: {changes} ({margin})"]
    lines.append(
        f"{best.tokens_per_s:,.1f} generated tokens/s, {best.rows_per_s:,.2f} rows/s, "
        f"TTFT p50 {best.ttft_ms:,.1f} ms, TPOT p50 {best.tpot_ms:,.2f} ms"
    )
    lines.append(prefix_line(search))
    lines.extend(f"not swept: {skipped}" for skipped in search.space.skipped)
    return lines
