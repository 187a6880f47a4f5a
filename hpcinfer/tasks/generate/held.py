"""What a checkpoint keeps of generation windows not yet committed, and how a resumed run takes it back.

Every `--commit-every` seconds the job checkpoints the answers finished since the last time in
windows still open (files/parts.py: one chunk per window): a table of the input `row` and its
`answer`, the output row as JSON exactly as the window's part would hold it. A resumed run re-reads
those windows, books a held row as answered without running it again (its answer depends only on
its prompt and its seed, not on its neighbours), and commits the window whole as before.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa


def answers_chunk(results: list[tuple[int, dict[str, Any]]]) -> pa.Table:
    """(input row, answer row) pairs -> a checkpoint chunk."""
    return pa.table(
        {
            "row": pa.array([row for row, _ in results], pa.int64()),
            "answer": pa.array([json.dumps(answer, default=str) for _, answer in results], pa.string()),
        }
    )


def held_answers(store: Any) -> dict[int, dict[str, Any]]:
    """Every answer the checkpoints of a resumed output hold, by input row."""
    held: dict[int, dict[str, Any]] = {}
    for window_id in sorted(store.partial):
        found = store.checkpointed(window_id)
        if found is None:
            continue
        table, _ = found
        for row, answer in zip(table.column("row").to_pylist(), table.column("answer").to_pylist(), strict=True):
            held[row] = json.loads(answer)
    return held
