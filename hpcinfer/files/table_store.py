"""A part store whose window becomes a table its subclass builds: a task's own output columns
(labels, token labels, sparse vectors) written as Parquet or JSONL like every part."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .part_format import write_jsonl_rows, write_parquet
from .parts import PartStore


class TableStore(PartStore, ABC):
    """`table(ids, values)`: a window's rows as the task writes them; the rest is PartStore's."""

    @abstractmethod
    def table(self, ids: list[Any], values: Any) -> pa.Table:
        """A window's ids and values (dense [rows, dim], or a head's `values.Ragged` items) as the output rows."""

    def empty_schema(self) -> pa.Schema:
        empty = self.ragged.empty() if self.ragged is not None else np.zeros((0, self.dim), np.float32)
        return self.table([], empty).schema

    def _write_part(
        self, tmp: Path, ids: list[Any], values: np.ndarray, meta: dict[str, list[Any]] | None, rejects: list[Any]
    ) -> None:
        table = self.table(ids, values)
        if self.fmt == "parquet":
            write_parquet(table, tmp)
        else:
            write_jsonl_rows(tmp, table.to_pylist())
