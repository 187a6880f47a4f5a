"""The tuning table (live while trials run) and the closing verdict."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from .gen_search import GenerationSearch, prefix_line
from .search import Goal, Search, Trial

_HEADERS = {
    "max_batch_tokens": "tokens",
    "max_batch_size": "rows",
    "streams": "streams",
    "staging_buffers": "buffers",
    "batch_timeout_ms": "timeout ms",
    "max_num_batched_tokens": "step tokens",
    "max_num_seqs": "seqs",
    "prefix_cache": "prefix",
}


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def trial_table(search: Search, status: str = "") -> Table:
    if isinstance(search, GenerationSearch):
        return generation_table(search, status)
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


def generation_table(search: GenerationSearch, status: str = "") -> Table:
    """Generation trials: generated tokens/s first, then rows/s, TTFT and TPOT (p50), the repeat spread."""
    table = Table(
        title="hpcinfer tune (TTFT, TPOT: p50; hits: prompt tokens served by the prefix cache)",
        title_justify="left",
        caption=status or None,
        caption_justify="left",
    )
    knobs = list(search.trials[0].params) if search.trials else []
    columns = ["#", *(_HEADERS[k] for k in knobs), "gen tok/s", "rows/s", "TTFT ms", "TPOT ms"]
    for col in [*columns, "spread", "hits", "MiB", "vs default", "status"]:
        table.add_column(col, justify="left" if col == "status" else "right")
    for t in search.trials:
        chosen = t is search.best
        table.add_row(
            str(t.index),
            *(_value(t.params[k]) for k in knobs),
            f"{t.tokens_per_s:,.1f}",
            f"{t.rows_per_s:,.2f}",
            f"{t.ttft_ms:,.1f}",
            f"{t.tpot_ms:,.2f}",
            f"{t.spread:.0%}" if t.repeats > 1 else "-",
            f"{t.cached_share:.0%}",
            f"{t.memory_bytes / 2**20:,.0f}",
            "" if t.gain is None else f"{t.gain:.2f}x",
            _status(t, chosen, search.goal),
            style="bold green" if chosen else ("dim" if t.status != "ok" else None),
        )
    return table


def trial_line(search: Search, trial: Trial) -> str:
    """One finished trial, for a log (no live table)."""
    params = " ".join(f"{k.replace('_', '-')}={_value(v)}" for k, v in trial.params.items())
    gain = "" if trial.gain is None else f" {trial.gain:.2f}x default"
    extra = f" [{trial.status}{': ' + trial.note if trial.note else ''}]" if trial.status != "ok" or trial.note else ""
    if isinstance(search, GenerationSearch):
        return (
            f"trial {trial.index} (of at most {search.space.most_trials}): {params}: "
            f"{trial.tokens_per_s:,.1f} generated tokens/s, {trial.rows_per_s:,.2f} rows/s, "
            f"TTFT p50 {trial.ttft_ms:,.1f} ms, TPOT p50 {trial.tpot_ms:,.2f} ms, "
            f"spread {trial.spread:.0%}{gain}{extra}"
        )
    return (
        f"trial {trial.index}: {params}: {trial.rows_per_s:,.1f} rows/s, p99 {trial.p99_ms:,.1f} ms, "
        f"{trial.memory_bytes / 2**20:,.0f} MiB{gain}{extra}"
    )


def verdict(search: Search) -> list[str]:
    if isinstance(search, GenerationSearch):
        return generation_verdict(search)
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


def generation_verdict(search: GenerationSearch) -> list[str]:
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
