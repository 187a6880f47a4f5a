"""What a checkpoint keeps of an embedding window that was not committed, and how it comes back.

A checkpoint chunk (files/parts.py) of a window is a table of the rows that had landed: `index`
(window-local row), `failed` (out of memory even alone), then their values: `embedding` (a
fixed-size list) for dense rows, or one list column per field for a head's ragged items (`item_`
and the field's name). Its facts
are the window's first row and input rows (a resumed window must be the same window) and the token
budget its batches were cut to (a resumed window is cut to it again, so its batches are the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..values import Ragged, RaggedSpec

ITEM = "item_"  # a ragged field's column in a chunk: this, then the field's name


@dataclass(slots=True)
class Held:
    """A window's rows that an interrupted run's checkpoints hold."""

    first_row: int
    input_rows: int
    cut_tokens: int
    rows: np.ndarray  # int64 [n]: window-local row indices
    values: Any  # float32 [n, dim], or Ragged (n rows)
    failed: np.ndarray  # bool [n]

    def fits(self, first_row: int, input_rows: int) -> bool:
        """The window now read is the one checkpointed (same input rows)."""
        return (self.first_row, self.input_rows) == (first_row, input_rows)


def window_facts(first_row: int, input_rows: int, cut_tokens: int) -> dict[str, Any]:
    return {"first_row": first_row, "input_rows": input_rows, "cut_tokens": cut_tokens}


def checkpoint_table(rows: np.ndarray, values: np.ndarray | Ragged, failed: np.ndarray) -> pa.Table:
    """A chunk of a window's finished rows."""
    columns = {"index": pa.array(rows, pa.int64()), "failed": pa.array(failed, pa.bool_())}
    if isinstance(values, Ragged):  # NOTE: prefixed: a field may be called `index` (SPLADE's)
        return pa.table(columns | {ITEM + name: column for name, column in values.columns().items()})
    dim = values.shape[1]
    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1), type=pa.float32())
    return pa.table(columns | {"embedding": pa.FixedSizeListArray.from_arrays(flat, dim)})


def held_rows(table: pa.Table, facts: dict[str, Any], dim: int, ragged: RaggedSpec | None = None) -> Held:
    """A window's chunks (concatenated) and facts -> Held."""
    if ragged is not None:
        values: Any = Ragged.from_columns({f.name: table.column(ITEM + f.name) for f in ragged.fields}, ragged)
    else:
        flat = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        values = flat.astype(np.float32, copy=False).reshape(table.num_rows, dim)
    return Held(
        int(facts["first_row"]),
        int(facts["input_rows"]),
        int(facts["cut_tokens"]),
        table.column("index").to_numpy().astype(np.int64),
        values,
        table.column("failed").to_numpy(zero_copy_only=False).astype(bool),
    )


def load_held(store: Any) -> dict[int, Held]:
    """Every checkpointed window of a resumed output (`store.partial`), by window id."""
    held = {}
    for window_id in sorted(store.partial):
        found = store.checkpointed(window_id)
        if found is not None:
            held[window_id] = held_rows(*found, store.dim, store.ragged)
    return held
