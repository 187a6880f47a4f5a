"""What a row's result is, as it travels from a head to the output: a dense vector (a float32 row
of a [rows, dim] array), or ragged items (`Ragged`: a varying number of items per row, each a
record of named fields: a token's label, score and id; a token's state vector; a vocabulary
entry's index and weight).

A head that gives ragged items says so with a `RaggedSpec` (its fields, and the most items a row
can have: the bound a window's memory is planned by). The executor brings a batch's items back
whole, the writer gathers a window's batches in input order, and checkpoint chunks and stores take
them as Arrow list columns: nothing on the way squeezes them into a dense row or pads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class RaggedField:
    """One field of an item: its name, numpy dtype and the shape of one item's value (() for a scalar)."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()

    @property
    def item_bytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


@dataclass(frozen=True, slots=True)
class RaggedSpec:
    """A head's ragged output: the fields of each item and the most items one row can have."""

    fields: tuple[RaggedField, ...]
    max_items: int

    @property
    def row_bytes(self) -> int:
        """The most bytes one row's items take (a window's memory is bounded by it)."""
        return self.max_items * sum(f.item_bytes for f in self.fields)

    def empty(self, rows: int = 0) -> Ragged:
        """`rows` rows of no items."""
        fields = {f.name: np.zeros((0, *f.shape), f.dtype) for f in self.fields}
        return Ragged(np.zeros(rows, np.int64), fields)


@dataclass(slots=True)
class Ragged:
    """Rows of a varying number of items: `counts` [rows] items per row, and each field's values
    for every row's items, flat and row after row ([sum(counts), *shape]). The arrays are numpy
    on the host; a head hands over torch tensors on its device, which the executor brings back."""

    counts: Any  # int64 [rows]
    fields: dict[str, Any]

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def items(self) -> int:
        return int(self.counts.sum())

    def offsets(self) -> np.ndarray:
        """int64 [rows + 1]: row r's items are [offsets[r], offsets[r + 1])."""
        out = np.zeros(len(self.counts) + 1, np.int64)
        np.cumsum(self.counts, out=out[1:])
        return out

    def __getitem__(self, rows: Any) -> Ragged:
        """The rows `rows` selects (a boolean mask or row indices, numpy's way), in that order."""
        index = np.arange(len(self.counts))[rows]
        counts = np.asarray(self.counts)[index]
        starts = self.offsets()[index]
        # NOTE: each selected row's items as one run of flat indices: starts repeated, plus 0..count-1
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        flat = np.repeat(starts, counts) + within
        return Ragged(counts, {name: values[flat] for name, values in self.fields.items()})

    def copy(self) -> Ragged:
        return Ragged(np.array(self.counts, np.int64), {k: np.array(v) for k, v in self.fields.items()})

    @staticmethod
    def concat(parts: list[Ragged]) -> Ragged:
        """The rows of `parts`, one part after the other (at least one part)."""
        counts = np.concatenate([np.asarray(p.counts, np.int64) for p in parts])
        fields = {name: np.concatenate([p.fields[name] for p in parts]) for name in parts[0].fields}
        return Ragged(counts, fields)

    def columns(self) -> dict[str, Any]:
        """Each field as an Arrow list column (one list of items per row; a shaped item a fixed-size list)."""
        import pyarrow as pa

        offsets = pa.array(self.offsets().astype(np.int32), pa.int32())
        out = {}
        for name, values in self.fields.items():
            flat = np.ascontiguousarray(values)
            items: Any = pa.array(flat.reshape(-1))
            for size in reversed(flat.shape[1:]):
                items = pa.FixedSizeListArray.from_arrays(items, size)
            out[name] = pa.ListArray.from_arrays(offsets, items)
        return out

    @staticmethod
    def from_columns(columns: dict[str, Any], spec: RaggedSpec) -> Ragged:
        """`columns()` read back (Arrow list columns by field name, chunked or not)."""
        counts: np.ndarray | None = None
        fields = {}
        for f in spec.fields:
            column = columns[f.name]
            column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
            if counts is None:
                offsets = column.offsets.to_numpy()
                counts = np.diff(offsets).astype(np.int64)
            flat = column.flatten()
            for _ in f.shape:
                flat = flat.flatten()
            fields[f.name] = flat.to_numpy(zero_copy_only=False).astype(f.dtype, copy=False).reshape(-1, *f.shape)
        assert counts is not None, "a ragged spec has fields"
        return Ragged(counts, fields)


def take_rows(values: Any, rows: Any) -> Any:
    """`values[rows]` for dense rows and ragged rows alike."""
    return values[rows]


__all__ = ["Ragged", "RaggedField", "RaggedSpec", "take_rows"]
