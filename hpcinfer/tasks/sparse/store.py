"""`--task sparse` output rows: `id`, then the row's non-zero vocabulary entries as `indices` (token
ids, ascending, int32) and `values` (float32). A row with none is written with empty lists."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ...files.part_format import id_array
from ...files.table_store import TableStore


def sparse_columns(values: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """[rows, vocab] -> (indices, values) list arrays of each row's non-zero entries, ascending."""
    rows, cols = np.nonzero(values)  # NOTE: row-major: each row's entries together, in ascending order
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(np.bincount(rows, minlength=len(values)), out=offsets[1:])
    offsets_array = pa.array(offsets, pa.int32())
    indices = pa.ListArray.from_arrays(offsets_array, pa.array(cols.astype(np.int32), pa.int32()))
    kept = pa.ListArray.from_arrays(offsets_array, pa.array(values[rows, cols].astype(np.float32), pa.float32()))
    return indices, kept


class SparseVectorStore(TableStore):
    """Parts of sparse rows, from the writer's dense [rows, vocab] values."""

    def table(self, ids: list[Any], values: np.ndarray) -> pa.Table:
        indices, kept = sparse_columns(values)
        return pa.table({"id": id_array(ids), "indices": indices, "values": kept})
