"""The driver's side of a unit's results: ids repeated across units, then the commit in window order.

A replica sees only its own window, so an id that first appeared in an earlier window passes its
duplicate check. The driver keeps the set of ids seen so far (across windows, in window order, as
the local reader does across blocks) and turns such rows into `duplicate_id` rejects before the
window is committed: the committed part is then what a local run commits for that window.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..files.ids import IdSet, id_key
from ..types import Reject
from .replica import Committed


def reject_from_json(data: dict[str, Any]) -> Reject:
    return Reject(
        data["row"], data["source"], data.get("line"), data["id"], data["reason"], data["message"], data["row_in_file"]
    )


def drop_repeated_ids(
    seen: IdSet, window: Committed, admitted: list[tuple[int, Any, int | None, str, int]]
) -> tuple[Committed, dict[str, int]]:
    """The window less its rows whose id an earlier window had; remembers the window's other ids.

    `admitted` is every row of the window that the replica's reader let through, in row order:
    (row, id, line, source, row in file). Returns the corrected window and, per source, how many of
    its written rows became rejects. A row whose id repeats is a `duplicate_id` reject even when the
    replica had rejected it later for another reason (too long, say): the local reader checks ids
    first, so that is what a local run reports.
    """
    rows = [a for a in admitted if a[1] is not None]
    keys = np.fromiter((id_key(a[1]) for a in rows), np.uint64, len(rows))
    repeated = seen.contains_many(keys)
    seen.add_many(keys[~repeated])
    if not repeated.any():
        return window, {}
    duplicates = {rows[k][0]: rows[k] for k in np.flatnonzero(repeated).tolist()}
    rejected = {r["row"] for r in window.rejects}
    written = [a[0] for a in admitted if a[0] not in rejected]
    assert len(written) == len(window.ids), "every admitted row is written or rejected"
    keep = np.array([row not in duplicates for row in written], dtype=bool)
    moved: dict[str, int] = {}
    for row in written:
        if row in duplicates:
            source = duplicates[row][3]
            moved[source] = moved.get(source, 0) + 1
    rejects = [r for r in window.rejects if r["row"] not in duplicates]
    for row, row_id, line, source, row_in_file in duplicates.values():
        rejects.append(
            Reject(row, source, line, row_id, "duplicate_id", f"id {row_id!r} appeared before", row_in_file).to_json()
        )
    rejects.sort(key=lambda r: r["row"])
    ids = [i for i, k in zip(window.ids, keep, strict=True) if k]
    return Committed(window.window_id, window.first_row, window.input_rows, ids, window.values[keep], rejects), moved


def drop_repeated_requests(
    seen: IdSet,
    answers: list[tuple[int, dict[str, Any]]],
    rejects: list[dict[str, Any]],
    admitted: list[tuple[int, Any, int | None, str, int]],
) -> tuple[list[tuple[int, dict[str, Any]]], list[dict[str, Any]], dict[str, int]]:
    """A generation window less its answers to requests whose id an earlier window had.

    `admitted` is every row of the window that took its id, in row order: (row, id, line, source,
    row in file). As with embedding's, a row whose id repeats is a `duplicate_id` reject even when
    the replica rejected it for its prompt: the local reader checks ids first. Returns the answers
    and rejects the local run commits for this window, and, per source, how many answers became
    rejects.
    """
    keys = np.fromiter((id_key(a[1]) for a in admitted), np.uint64, len(admitted))
    repeated = seen.contains_many(keys)
    seen.add_many(keys[~repeated])  # NOTE: the replica already rejected ids repeated within the window
    if not repeated.any():
        return answers, rejects, {}
    duplicates = {admitted[k][0]: admitted[k] for k in np.flatnonzero(repeated).tolist()}
    answered = {row for row, _ in answers}
    moved: dict[str, int] = {}
    added = []
    for row, row_id, line, source, row_in_file in duplicates.values():
        if row in answered:
            moved[source] = moved.get(source, 0) + 1
        added.append(
            Reject(row, source, line, row_id, "duplicate_id", f"id {row_id!r} appeared before", row_in_file).to_json()
        )
    kept = [(row, answer) for row, answer in answers if row not in duplicates]
    others = [r for r in rejects if r["row"] not in duplicates]
    assert len(kept) + len(others) + len(added) == len(answers) + len(rejects), "every row answered or rejected"
    return kept, sorted(others + added, key=lambda r: r["row"]), moved
