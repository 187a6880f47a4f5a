"""The lines `hpcinfer run` prints besides the report: which task `--task auto` picked (before the
run starts), and how many rows were rejected and where they went (even with -q)."""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..errors import HpcinferError


def task_line(config: RunConfig) -> str | None:
    """`task: embed (--task auto: an encoder)`; None for a task given, or a model that cannot be
    read (the run then fails on it with its own one-line error)."""
    if config.task != "auto":
        return None
    from ..registry import auto_task

    try:
        task, why = auto_task(config)
    except (HpcinferError, OSError):
        return None
    return f"task: {task} (--task auto: {why})"


def rejects_line(report: Any, output: str) -> str | None:
    """`3 of 5 rows rejected: see out.jsonl.rejects.jsonl` (the path as the output was given); None
    when no row was rejected."""
    from ..files.parts import rejects_path

    books = getattr(report, "accounting", None) or {}
    rejected = books.get("rows_rejected", sum(getattr(report, "rejects", {}).values()))
    if not rejected:
        return None
    read = books.get("rows_read")
    of = f" of {read:,}" if read else ""
    return f"{rejected:,}{of} rows rejected: see {rejects_path(output)}"
