"""Stage 1, read: input files -> RowBlocks, streamed as pyarrow record batches.

Accepts JSONL, Parquet and OpenAI-style batch JSONL (`custom_id`, `body.input`); one file, several,
a directory or a glob of shards. Whole-input problems (missing file, unknown column, unreadable
file) are raised up front as InputError, before any work starts.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from .config import InputConfig
from .errors import InputError
from .types import RowBlock

_SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
TOKENS_COLUMN = "input_ids"


@dataclass(frozen=True, slots=True)
class Source:
    path: str
    fmt: str  # jsonl | parquet | openai
    payload: str  # "text" or "tokens"
    has_ids: bool


def expand_paths(specs: tuple[str, ...]) -> list[str]:
    """Files, directories (their data files, sorted) and globs -> a list of files, in order."""
    files: list[str] = []
    for spec in specs:
        if any(ch in spec for ch in "*?["):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise InputError("no file matches this pattern", path=spec)
            files.extend(matches)
        elif os.path.isdir(spec):
            found = sorted(str(p) for p in Path(spec).iterdir() if p.suffix.lower() in _SUFFIX_FORMATS)
            if not found:
                raise InputError("directory holds no .jsonl or .parquet file", path=spec)
            files.extend(found)
        elif os.path.isfile(spec):
            files.append(spec)
        else:
            raise InputError("no such file or directory", path=spec)
    return files


def _first_json_object(path: str) -> dict | None:
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    obj = json.loads(line)
                    return obj if isinstance(obj, dict) else None
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror})", path=path) from None
    except ValueError:
        raise InputError("first line is not valid JSON", path=path) from None
    return None


def _columns_of(path: str, fmt: str) -> set[str]:
    if fmt == "parquet":
        try:
            return set(pq.read_schema(path).names)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"not a readable Parquet file ({exc})", path=path) from None
    first = _first_json_object(path)
    return set(first) if first else set()


def open_source(path: str, cfg: InputConfig) -> Source:
    """Detects the format and checks the columns of one file."""
    fmt = cfg.input_format
    if fmt == "auto":
        fmt = _SUFFIX_FORMATS.get(Path(path).suffix.lower(), "")
        if not fmt:
            raise InputError("unknown file type (expected .jsonl or .parquet; see --input-format)", path=path)
    if fmt == "jsonl":
        first = _first_json_object(path)
        if first is not None and "custom_id" in first and isinstance(first.get("body"), dict):
            fmt = "openai"
    if fmt == "openai":
        return Source(path, "openai", "text", True)
    columns = _columns_of(path, fmt)
    if not columns:  # an empty file has no rows and no columns to check
        return Source(path, fmt, "text", cfg.id_column in columns)
    if cfg.text_column in columns:
        payload = "text"
    elif TOKENS_COLUMN in columns:
        payload = "tokens"
    else:
        shown = ", ".join(sorted(columns)[:8])
        raise InputError(f"no column '{cfg.text_column}' (nor '{TOKENS_COLUMN}'); columns are: {shown}", path=path)
    return Source(path, fmt, payload, cfg.id_column in columns)


def _record_batches(src: Source, cfg: InputConfig, columns: list[str]) -> Iterator[pa.RecordBatch]:
    try:
        if src.fmt == "parquet":
            yield from pq.ParquetFile(src.path).iter_batches(batch_size=cfg.read_block_rows, columns=columns)
            return
        if os.path.getsize(src.path) == 0:
            return
        schema = pa.schema([(cfg.text_column, pa.string())]) if src.payload == "text" else None
        reader = pj.open_json(
            src.path,
            read_options=pj.ReadOptions(block_size=1 << 20),
            parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer"),
        )
        for batch in reader:
            yield batch.select([c for c in columns if c in batch.schema.names])
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"cannot read ({exc})", path=src.path) from None


def _openai_blocks(src: Source, rows_per_block: int) -> Iterator[tuple[list, list[str]]]:
    """OpenAI batch lines: {"custom_id": ..., "body": {"input": "..."}}; custom_id is the id."""
    ids: list = []
    texts: list[str] = []
    with open(src.path, "rb") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                text = obj["body"]["input"]
                if isinstance(text, list) and len(text) == 1:
                    text = text[0]
                if not isinstance(text, str):
                    raise TypeError("body.input must be one string")
                ids.append(obj["custom_id"])
            except (ValueError, KeyError, TypeError) as exc:
                raise InputError(f"line {line_no}: not an embeddings request ({exc})", path=src.path) from None
            texts.append(text)
            if len(ids) == rows_per_block:
                yield ids, texts
                ids, texts = [], []
    if ids:
        yield ids, texts


def _token_lists(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A list<int> column -> (flat int32 ids, int32 lengths) without Python objects per token."""
    column = column.cast(pa.list_(pa.int32())) if column.type != pa.list_(pa.int32()) else column
    offsets = column.offsets.to_numpy()
    flat = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    return np.ascontiguousarray(flat, dtype=np.int32), np.diff(offsets).astype(np.int32)


class Reader:
    """Produces RowBlocks of at most `read_block_rows` rows; ids default to the global row number."""

    name = "read"

    def __init__(self, cfg: InputConfig) -> None:
        self.cfg = cfg
        self.sources = [open_source(p, cfg) for p in expand_paths(cfg.paths)]
        self.rows_read = 0
        self._block_id = 0

    def produce(self) -> Iterator[RowBlock]:
        for src in self.sources:
            yield from self._read_source(src)

    def _block(self, src: Source, ids: list | None, n: int, **payload: object) -> RowBlock:
        first = self.rows_read
        if ids is None:
            ids = list(range(first, first + n))
        block = RowBlock(self._block_id, first, src.path, ids, **payload)  # type: ignore[arg-type]
        self._block_id += 1
        self.rows_read += n
        return block

    def _read_source(self, src: Source) -> Iterator[RowBlock]:
        if src.fmt == "openai":
            for ids, texts in _openai_blocks(src, self.cfg.read_block_rows):
                yield self._block(src, ids, len(ids), texts=texts)
            return
        payload_col = self.cfg.text_column if src.payload == "text" else TOKENS_COLUMN
        columns = [payload_col] + ([self.cfg.id_column] if src.has_ids else [])
        for batch in _record_batches(src, self.cfg, columns):
            for start in range(0, batch.num_rows, self.cfg.read_block_rows):
                part = batch.slice(start, self.cfg.read_block_rows)
                ids = part.column(self.cfg.id_column).to_pylist() if src.has_ids else None
                col = part.column(payload_col)
                if src.payload == "text":
                    yield self._block(src, ids, part.num_rows, texts=col.to_pylist())
                else:
                    yield self._block(src, ids, part.num_rows, token_ids=_token_lists(col))


def estimate_rows(sources: list[Source]) -> int | None:
    """Exact for Parquet (footer metadata); JSONL is estimated from the first MiB's line sizes."""
    total = 0
    for src in sources:
        if src.fmt == "parquet":
            total += pq.ParquetFile(src.path).metadata.num_rows
            continue
        size = os.path.getsize(src.path)
        with open(src.path, "rb") as fh:
            sample = fh.read(1 << 20)
        lines = sample.count(b"\n") + (1 if sample and not sample.endswith(b"\n") else 0)
        if lines == 0:
            continue
        total += lines if len(sample) == size else round(size / (len(sample) / lines))
    return total
