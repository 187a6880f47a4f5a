"""The driver's side of a unit's results: ids repeated across units become rejects.

A replica sees only its own window, so an id that first appeared in an earlier window passes its
duplicate check. The driver keeps the set of ids seen so far (across windows, in window order, as
the local reader does across blocks) and turns such rows into `duplicate_id` rejects before the
window is committed: the committed part is then what a local run commits for that window. A row
takes its id before its content is checked, so a row the replica rejected for its content is a
`duplicate_id` reject all the same, as in a local run. Each task removes the repeated rows from
its own results (tasks/*/cluster.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..files.ids import IdSet, id_key
from ..types import Reject

Admitted = tuple[int, Any, int | None, str, int]  # (row, id, line, source, row in file)


def reject_from_json(data: dict[str, Any]) -> Reject:
    return Reject(
        data["row"], data["source"], data.get("line"), data["id"], data["reason"], data["message"], data["row_in_file"]
    )


def repeated_rows(seen: IdSet, admitted: list[Admitted]) -> dict[int, Admitted]:
    """{row: its admitted entry} for the rows whose id an earlier window had; remembers the others' ids.

    `admitted` is every row of the window that took its id, in row order.
    """
    rows = [a for a in admitted if a[1] is not None]
    keys = np.fromiter((id_key(a[1]) for a in rows), np.uint64, len(rows))
    repeated = seen.contains_many(keys)
    seen.add_many(keys[~repeated])  # NOTE: the replica already rejected ids repeated within the window
    return {rows[k][0]: rows[k] for k in np.flatnonzero(repeated).tolist()}


def with_duplicate_rejects(
    rejects: list[dict[str, Any]], duplicates: dict[int, Admitted], written: set[int]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The window's rejects with each repeated row's reject made `duplicate_id` (replacing any other),
    in row order; and, per source, how many of the `written` rows became rejects."""
    moved: dict[str, int] = {}
    out = [r for r in rejects if r["row"] not in duplicates]
    for row, row_id, line, source, row_in_file in duplicates.values():
        if row in written:
            moved[source] = moved.get(source, 0) + 1
        out.append(
            Reject(row, source, line, row_id, "duplicate_id", f"id {row_id!r} appeared before", row_in_file).to_json()
        )
    return sorted(out, key=lambda r: r["row"]), moved
