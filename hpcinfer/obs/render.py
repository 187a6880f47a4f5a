"""Human output on stderr: each report renders itself; the pieces every task's report shares."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def render(report: Any, console: Console) -> None:
    """The report's tables on stderr (each task's report knows its own)."""
    report.render(console)


def rows_table(title: str, rows: list[dict[str, Any]], columns: tuple[tuple[str, str, str], ...]) -> Table:
    """A table of dict rows, one column per (header, key, format spec); the first column left-aligned."""
    table = Table(title=title, title_justify="left")
    for i, (header, _, _) in enumerate(columns):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(format(row[key], spec) for _, key, spec in columns))
    return table


def cluster_line(report: Any) -> str:
    """The Ray run in one line: replicas, the slowest actor, restarts, and the windows moved away
    from replicas that failed (their breakers' transitions have lines of their own)."""
    c = report.cluster
    parts = [f"ray: {c['replicas']} replicas", f"slowest actor {c['slowest_actor']}"]
    parts.append(f"actor restarts seen {c['actor_restarts_seen']}")
    for replica, m in c.get("moved_from", {}).items():
        windows = f"{m['windows']:,} window{'s' if m['windows'] != 1 else ''}"
        parts.append(f"moved {windows} ({m['rows']:,} rows) from {replica}")
    return ", ".join(parts)
