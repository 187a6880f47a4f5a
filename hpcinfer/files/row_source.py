"""The rows of one input file, or of one segment of it, as each format stores them: the one place
every reader (both tasks', whole-input and range) gets its raw rows from.

JSONL comes as numbered lines, in chunks of about `chunk_bytes` (`lines.LineSplitter`: lines of
any length, a BOM, CRLF, blank lines skipped); Parquet as record batches of `batch_rows`, only the
columns asked for. A whole file read to its end is checked: every byte of a JSONL file went to the
splitter, a Parquet file gave the rows its footer counts; a segment must give all of its rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputError
from . import storage
from .lines import LineSplitter

PARQUET_BLOCK_BYTES = 8 << 20  # an object's Parquet data is fetched in ranges of at least this much


@dataclass(frozen=True, slots=True)
class Segment:
    """The rows of one unit of work (a window) that come from one file."""

    path: str
    file_first_row: int  # global row number of the file's first row
    start: int  # first row, counted within the file
    rows: int
    offset: int = 0  # JSONL: byte offset of the line holding row `start`
    line: int = 1  # JSONL: its 1-based line number


def jsonl_chunks(path: str, chunk_bytes: int, seg: Segment | None = None) -> Iterator[list[tuple[int, bytes]]]:
    """Non-empty chunks of (line number, line) of the file, or of the segment's rows."""
    try:
        with storage.open_binary(path, block_size=max(chunk_bytes, 1 << 20)) as fh:
            if seg is None:
                size = fh.size if storage.is_remote(path) else os.fstat(fh.fileno()).st_size
                splitter = LineSplitter(fh, chunk_bytes)
                yield from (numbered for numbered in splitter.chunks() if numbered)
                if splitter.bytes_seen != size:
                    raise InputError(
                        f"read stopped at byte {splitter.bytes_seen:,} of {size:,} (did the file change while read?)",
                        path=storage.shown(path),
                    )
                return
            fh.seek(seg.offset)
            left = seg.rows
            for numbered in LineSplitter(fh, chunk_bytes, first_line=seg.line).chunks():
                numbered = numbered[:left]
                if numbered:
                    left -= len(numbered)
                    yield numbered
                if not left:
                    return
    except storage.errors() as exc:
        raise InputError(f"cannot read ({storage.failure(exc)})", path=storage.shown(path)) from None


def parquet_batches(
    path: str, batch_rows: int, columns: list[str] | None = None, seg: Segment | None = None
) -> Iterator[pa.RecordBatch]:
    """Record batches of the file (checked against its footer), or of the segment's rows."""
    try:
        with open_parquet(path) as file:
            if seg is not None:
                yield from parquet_range(file, seg, batch_rows, columns)
                return
            seen = 0
            for batch in file.iter_batches(batch_size=batch_rows, columns=columns):
                seen += batch.num_rows
                yield batch
            if seen != file.metadata.num_rows:
                raise InputError(
                    f"read {seen:,} rows but the footer says {file.metadata.num_rows:,}", path=storage.shown(path)
                )
    except pa.ArrowException as exc:
        raise InputError(f"cannot read ({exc})", path=storage.shown(path)) from None
    except storage.errors() as exc:
        raise InputError(f"cannot read ({storage.failure(exc)})", path=storage.shown(path)) from None


@contextmanager
def open_parquet(path: str) -> Iterator[pq.ParquetFile]:
    """A Parquet file to read from: a local one as pyarrow opens it, an object through its store's
    file (ranged reads, so a row group at a time is fetched, never the whole object)."""
    if not storage.is_remote(path):
        with pq.ParquetFile(storage.local_path(path)) as file:
            yield file
        return
    with storage.open_binary(path, block_size=PARQUET_BLOCK_BYTES) as fh, pq.ParquetFile(fh) as file:
        yield file


def parquet_range(
    file: pq.ParquetFile, seg: Segment, batch_rows: int, columns: list[str] | None = None
) -> Iterator[pa.RecordBatch]:
    """The segment's rows of a Parquet file, in record batches: only the row groups holding them are
    decoded, the first and last trimmed."""
    groups, skip, first = [], 0, 0
    for g in range(file.metadata.num_row_groups):
        n = file.metadata.row_group(g).num_rows
        if first + n > seg.start and first < seg.start + seg.rows:
            if not groups:
                skip = seg.start - first
            groups.append(g)
        first += n
    left = seg.rows
    for batch in file.iter_batches(batch_size=batch_rows, row_groups=groups, columns=columns):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        batch, skip = batch.slice(skip, left), 0
        left -= batch.num_rows
        yield batch
        if not left:
            return
