"""What a part file holds, and how parts join into one output: the rows' columns and lines.

An embedding part is a table of ids and fixed-size float32 vectors (`results_table`); ids of any
part are one Arrow column (`id_array`); a JSONL part is one JSON object a line (`write_jsonl_rows`),
or lines a task already wrote (`RAW_LINE`). At the end Parquet parts are streamed into one file
under one schema (`concat_parquet`, `unified_schema`) and JSONL parts are concatenated as bytes
(`concat_bytes`); one local part already in the output's form becomes the output by a hard link.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ASSEMBLE_BATCH_ROWS = 16_384  # rows per record batch when the parts are assembled
RAW_LINE = "_json_line"  # a table column of finished JSON lines: a JSONL part writes them as they are


def results_table(ids: list[Any], values: np.ndarray, dim: int) -> pa.Table:
    flat = pa.array(values.reshape(-1), type=pa.float32())
    return pa.table({"id": id_array(ids), "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)})


def settle_arrow() -> None:
    """pyarrow imports pandas, where it is installed, the first time it converts Python objects
    (0.2-0.35 s of one core): a run pays it here, before its clock starts, not inside its first
    commit, where it would stall the loop that commits and land in the latency of every row
    waiting then (under `--rate`)."""
    pa.array([0])


def id_array(ids: list[Any]) -> pa.Array:
    """Ids as one Arrow column: integers or strings, nulls kept as nulls."""
    try:
        return pa.array(ids) if ids else pa.array([], pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # mixed types, or beyond 64 bits: as text
        return pa.array([None if i is None else str(i) for i in ids], pa.string())


def write_jsonl_rows(path: Path, rows: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, default=str) + "\n")


class PartSource(Protocol):
    """Where parts are read from (folder.py): `source(name)` gives a path or an open file."""

    def source(self, name: str) -> AbstractContextManager[Path | IO[bytes]]: ...


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """How parts and outputs are written: zstd, and dictionary pages only for columns whose values
    can repeat (ids, labels, token ids); floats (embeddings, scores) are written plain, since
    building a dictionary of them costs time (a third of a token-embedding part's write) for none.
    """

    def leaves(name: str, kind: pa.DataType) -> list[tuple[str, pa.DataType]]:
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            return leaves(f"{name}.list.element", kind.value_type)
        if pa.types.is_struct(kind):
            fields = [kind.field(i) for i in range(kind.num_fields)]
            return [leaf for f in fields for leaf in leaves(f"{name}.{f.name}", f.type)]
        return [(name, kind)]

    paths = [leaf for field in schema for leaf in leaves(field.name, field.type)]
    return {"compression": "zstd", "use_dictionary": [p for p, kind in paths if not pa.types.is_floating(kind)]}


ROW_GROUP_BYTES = 32 << 20  # NOTE: the writer holds a row group's pages until it ends: a bounded one reuses them


def write_parquet(table: pa.Table, where: Any) -> None:
    """A part or a checkpoint chunk, as `parquet_options` says, in row groups of about
    ROW_GROUP_BYTES: a window of large rows (token embeddings: 128 MB a thousand rows) written as
    one row group costs twice the time in fresh memory the writer takes and touches."""
    rows = max(1, ROW_GROUP_BYTES * table.num_rows // max(1, table.nbytes))
    pq.write_table(table, where, row_group_size=rows, **parquet_options(table.schema))


def concat_parquet(sink: Path | IO[bytes], folder: PartSource, parts: list[str], empty_schema: pa.Schema) -> None:
    """Every Parquet part into one file (at a path, or into an open file), in order, under `unified_schema`."""
    schema = unified_schema(folder, parts, empty_schema)
    if len(parts) == 1:
        with folder.source(parts[0]) as where:
            own = pq.read_schema(where)
        if own.equals(schema, check_metadata=False):
            # NOTE: one part already in the output's schema is the output: its bytes are copied,
            # not decoded and encoded again (a large output's assembly would cost seconds per GB)
            concat_bytes(sink, folder, parts)
            return
    with pq.ParquetWriter(sink, schema, **parquet_options(schema)) as writer:
        for part in parts:
            # NOTE: streamed a record batch at a time, single-threaded: reading a whole part
            # (multi-threaded decode) costs a transient RSS spike of several times its size at
            # the very end of the run, which is where the run's peak would otherwise be.
            with folder.source(part) as where, pq.ParquetFile(where) as source:
                # NOTE: a row group at most (about ROW_GROUP_BYTES): rows of token embeddings are large
                group = source.metadata.row_group(0).num_rows if source.metadata.num_row_groups else 1
                rows = max(1, min(ASSEMBLE_BATCH_ROWS, group))
                for batch in source.iter_batches(batch_size=rows, use_threads=False):
                    writer.write_table(pa.Table.from_batches([batch]).cast(schema))


def unified_schema(folder: PartSource, parts: list[str], schema: pa.Schema) -> pa.Schema:
    """One schema for every part: ids are integers where every part's are, else text.

    A part's id type follows its own rows (integers, strings, all-null, or an empty part), so
    parts of one run can differ; their footers say how, without reading the data.
    """
    kinds = set()
    for part in parts:
        with folder.source(part) as where:
            meta = pq.read_metadata(where)
        if meta.num_rows:
            kinds.add(meta.schema.to_arrow_schema().field("id").type)
    kinds.discard(pa.null())
    id_type = kinds.pop() if len(kinds) == 1 else pa.string()
    return schema.set(schema.get_field_index("id"), pa.field("id", id_type))


@contextlib.contextmanager
def opened(where: Path | IO[bytes], mode: str = "rb") -> Iterator[IO[bytes]]:
    """A file at a path, opened; or a file already open, as it is (its owner closes it)."""
    if isinstance(where, Path):
        with open(where, mode) as fh:
            yield fh
    else:
        yield where


def concat_bytes(sink: Path | IO[bytes], folder: PartSource, parts: list[str]) -> None:
    if len(parts) == 1 and isinstance(sink, Path) and _linked(sink, folder, parts[0]):
        return
    with opened(sink, "wb") as out:
        for part in parts:
            with folder.source(part) as where, opened(where) as fh:
                shutil.copyfileobj(fh, out, 1 << 20)


def _linked(sink: Path, folder: PartSource, part: str) -> bool:
    """One local part is the output's bytes already: a second name for its file (a hard link) in
    place of a copy. A run that fits one window (token embeddings: ~128 MB a thousand rows) would
    otherwise read, write and fsync its whole output again at its very end, where nothing overlaps
    it. Parts are only ever replaced by a rename, never written in place, so the output cannot
    change under its reader; the parts folder's removal then leaves the output the file's only
    name. Where a link cannot be made (another file system, one without links), the bytes are
    copied."""
    with folder.source(part) as where:
        if not isinstance(where, Path):
            return False
        try:
            os.link(where, sink)
        except OSError:
            return False
    return True


__all__ = [
    "parquet_options",
    "write_parquet",
    "ASSEMBLE_BATCH_ROWS",
    "RAW_LINE",
    "concat_bytes",
    "concat_parquet",
    "id_array",
    "opened",
    "results_table",
    "unified_schema",
    "write_jsonl_rows",
]
