"""`--task sparse` output rows: `id`, then the row's non-zero vocabulary entries as `indices` (token
ids, ascending, int32) and `values` (float32). A row with none is written with empty lists."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from ...files.part_format import id_array
from ...files.parts import TableStore
from ...models.checkpoint import CheckpointInfo
from ...values import Ragged


class SparseVectorStore(TableStore):
    """Parts of sparse rows: each row's non-zero entries, as the head gave them (ragged items)."""

    def __init__(self, output: str, fmt: str, info: CheckpointInfo, fp: dict[str, Any]) -> None:
        super().__init__(output, fmt, info.output_dim, fp)
        self.ragged = info.ragged

    def table(self, ids: list[Any], values: Ragged) -> pa.Table:
        columns = values.columns()
        return pa.table({"id": id_array(ids), "indices": columns["index"], "values": columns["value"]})
