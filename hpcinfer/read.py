"""Stage 1, read: input files -> RowBlocks, streamed.

Accepts JSONL, Parquet and OpenAI-style batch JSONL (`custom_id`, `body.input`); one file, several,
a directory or a glob of shards. Whole-input problems (missing file, unknown column, unreadable
file) are raised up front as InputError. A bad row becomes a Reject and the run goes on.

Blocks never straddle a window boundary (a multiple of `window_rows` input rows), so windows are
the same in every run over the same input, which is what makes resume exact.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from .config import InputConfig
from .errors import InputError
from .types import Reject, RowBlock

_SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
TOKENS_COLUMN = "input_ids"
_CHUNK_BYTES = 1 << 20


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


def _json_objects(path: str, limit: int = 1000) -> list[dict]:
    """The JSON objects among the first `limit` lines (bad lines are the rows' problem, not the file's)."""
    found = []
    try:
        with open(path, "rb") as fh:
            for n, line in enumerate(fh):
                if n >= limit:
                    break
                try:
                    obj = json.loads(line) if line.strip() else None
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    found.append(obj)
    except OSError as exc:
        raise InputError(f"cannot read file ({exc.strerror})", path=path) from None
    return found


def open_source(path: str, cfg: InputConfig) -> Source:
    """Detects the format and checks the columns of one file."""
    fmt = cfg.input_format
    if fmt == "auto":
        fmt = _SUFFIX_FORMATS.get(Path(path).suffix.lower(), "")
        if not fmt:
            raise InputError("unknown file type (expected .jsonl or .parquet; see --input-format)", path=path)
    objects = _json_objects(path) if fmt in ("jsonl", "openai") else []
    if fmt == "jsonl" and objects and "custom_id" in objects[0] and isinstance(objects[0].get("body"), dict):
        fmt = "openai"
    if fmt == "openai":
        return Source(path, "openai", "text", True)
    if fmt == "parquet":
        try:
            schema = pq.read_schema(path)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"not a readable Parquet file ({exc})", path=path) from None
        columns = set(schema.names)
    else:
        columns = {key for obj in objects for key in obj}
    if fmt == "jsonl" and (not objects or cfg.text_column in columns):
        return Source(path, fmt, "text", cfg.id_column in columns)  # a row lacking text becomes a reject
    if cfg.text_column in columns:
        kind = schema.field(cfg.text_column).type if fmt == "parquet" else pa.string()
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise InputError(f"column '{cfg.text_column}' holds {kind}, not text", path=path)
        return Source(path, fmt, "text", cfg.id_column in columns)
    if TOKENS_COLUMN in columns:
        return Source(path, fmt, "tokens", cfg.id_column in columns)
    shown = ", ".join(sorted(columns)[:8])
    raise InputError(f"no column '{cfg.text_column}' (nor '{TOKENS_COLUMN}'); columns are: {shown}", path=path)


class _Rows:
    """Parsed rows of one chunk: per-row payload or reject, plus ids and line numbers."""

    def __init__(self) -> None:
        self.payloads: list[Any] = []  # str, list[int] or a Reject
        self.ids: list[Any] = []
        self.lines: list[int | None] = []


def _check_text(value: Any) -> tuple[str, str] | None:
    if value is None:
        return "missing_text", "no text"
    if not isinstance(value, str):
        return "wrong_type", f"text is a {type(value).__name__}, not a string"
    if not value.strip():
        return "empty_text", "text is empty or whitespace"
    return None


def _check_tokens(value: Any) -> tuple[str, str] | None:
    if value is None:
        return "missing_text", "no input_ids"
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "wrong_type", "input_ids must be a list of integers"
    if not value:
        return "empty_text", "input_ids is empty"
    return None


class Reader:
    """Produces RowBlocks of at most `read_block_rows` input rows, never crossing a window edge.

    `skip_rows` input rows are skipped (resume); ids default to the global input row number;
    a repeated id is a reject (`seen_ids` carries the ids already written, on resume).
    """

    name = "read"

    def __init__(self, cfg: InputConfig, window_rows: int, skip_rows: int = 0, seen_ids: set | None = None) -> None:
        self.cfg = cfg
        self.window_rows = window_rows
        self.sources = [open_source(p, cfg) for p in expand_paths(cfg.paths)]
        self.skip_rows = skip_rows
        self.skip_done = 0
        self.rows_read = 0  # input rows consumed, rejects and skipped rows included
        self._block_id = 0
        self._seen = IdSet()
        self._seen.update(seen_ids or ())

    def remember_ids(self, keys: Iterable[int]) -> None:
        """Ids already written by an interrupted run (as id_key values): a repeat is a duplicate."""
        self._seen.update(keys)

    def produce(self) -> Iterator[RowBlock]:
        limit = self.cfg.limit
        for src in self.sources:
            for rows, first_line in self._chunks(src):
                for block in self._blocks(src, rows, first_line):
                    yield block
                    if limit is not None and self.rows_read >= self.skip_done + limit:
                        return

    # -- chunking: each yields parsed rows in bounded chunks --------------------------------------

    def _chunks(self, src: Source) -> Iterator[tuple[_Rows, int]]:
        try:
            if src.fmt == "parquet":
                yield from self._parquet_chunks(src)
            else:
                yield from self._jsonl_chunks(src)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"cannot read ({exc})", path=src.path) from None

    def _parquet_chunks(self, src: Source) -> Iterator[tuple[_Rows, int]]:
        payload_col = self.cfg.text_column if src.payload == "text" else TOKENS_COLUMN
        columns = [payload_col] + ([self.cfg.id_column] if src.has_ids else [])
        for batch in pq.ParquetFile(src.path).iter_batches(batch_size=self.cfg.read_block_rows, columns=columns):
            rows = _Rows()
            values = batch.column(payload_col)
            if src.payload == "text":
                rows.payloads = _fast_text_check(values)
            else:
                rows.payloads = [v if (bad := _check_tokens(v)) is None else bad for v in values.to_pylist()]
            rows.ids = batch.column(self.cfg.id_column).to_pylist() if src.has_ids else [None] * batch.num_rows
            rows.lines = [None] * batch.num_rows
            yield rows, 0

    def _jsonl_chunks(self, src: Source) -> Iterator[tuple[_Rows, int]]:
        line_no = 0
        with open(src.path, "rb") as fh:
            tail = b""
            while True:
                data = fh.read(_CHUNK_BYTES)
                if not data and not tail:
                    return
                data, tail = (tail + data, b"") if not data else _split_tail(tail + data)
                lines = data.split(b"\n")
                if lines and lines[-1] == b"":
                    lines.pop()
                numbered = [(line_no + i + 1, line) for i, line in enumerate(lines) if line.strip()]
                line_no += len(lines)
                yield self._parse_lines(src, numbered), line_no
                if not data:
                    return

    def _parse_lines(self, src: Source, numbered: list[tuple[int, bytes]]) -> _Rows:
        rows = _Rows()
        if src.fmt == "jsonl" and src.payload == "text" and numbered:
            fast = self._fast_jsonl(numbered)
            if fast is not None:
                return fast
        for line_no, raw in numbered:
            rows.lines.append(line_no)
            payload, row_id = self._parse_line(src, raw)
            rows.payloads.append(payload)
            rows.ids.append(row_id)
        return rows

    def _fast_jsonl(self, numbered: list[tuple[int, bytes]]) -> _Rows | None:
        """pyarrow parses a clean chunk in one call; any problem falls back to line by line."""
        text_col, id_col = self.cfg.text_column, self.cfg.id_column
        try:
            table = pj.read_json(
                io.BytesIO(b"\n".join(raw for _, raw in numbered)),
                parse_options=pj.ParseOptions(
                    explicit_schema=pa.schema([(text_col, pa.string())]), unexpected_field_behavior="infer"
                ),
            )
        except (pa.ArrowException, UnicodeDecodeError, ValueError):
            return None
        if table.num_rows != len(numbered):
            return None
        rows = _Rows()
        try:  # NOTE: pyarrow does not validate UTF-8 while parsing; converting does
            rows.payloads = _fast_text_check(table.column(text_col))
            rows.ids = table.column(id_col).to_pylist() if id_col in table.column_names else [None] * table.num_rows
        except UnicodeDecodeError:
            return None
        rows.lines = [n for n, _ in numbered]
        return rows

    def _parse_line(self, src: Source, raw: bytes) -> tuple[Any, Any]:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return ("invalid_utf8", f"not UTF-8 ({exc.reason} at byte {exc.start})"), None
        except ValueError as exc:
            return ("malformed_json", f"not valid JSON ({exc})"), None
        if not isinstance(obj, dict):
            return ("malformed_json", f"a JSON {type(obj).__name__}, not an object"), None
        if src.fmt == "openai":
            body = obj.get("body")
            text = body.get("input") if isinstance(body, dict) else None
            if isinstance(text, list) and len(text) == 1:
                text = text[0]
            return (text if (bad := _check_text(text)) is None else bad), obj.get("custom_id")
        row_id = obj.get(self.cfg.id_column)
        if src.payload == "tokens":
            value = obj.get(TOKENS_COLUMN)
            return (value if (bad := _check_tokens(value)) is None else bad), row_id
        value = obj.get(self.cfg.text_column)
        return (value if (bad := _check_text(value)) is None else bad), row_id

    # -- blocks ----------------------------------------------------------------------------------

    def _blocks(self, src: Source, rows: _Rows, _line: int) -> Iterator[RowBlock]:
        n = len(rows.payloads)
        start = 0
        if self.skip_rows:  # resume: drop input rows already committed
            start = min(n, self.skip_rows)
            self.skip_rows -= start
            self.skip_done += start
            self.rows_read += start
        while start < n:
            room = self.window_rows - self.rows_read % self.window_rows
            end = min(n, start + self.cfg.read_block_rows, start + room)
            if self.cfg.limit is not None:
                end = min(end, start + self.skip_done + self.cfg.limit - self.rows_read)
            yield self._block(src, rows, start, end)
            start = end

    def _block(self, src: Source, rows: _Rows, start: int, end: int) -> RowBlock:
        first = self.rows_read
        block = RowBlock(self._block_id, first, end - start, src.path, [])
        payloads, lines = rows.payloads[start:end], rows.lines[start:end]
        ids = [first + k if row_id is None else row_id for k, row_id in enumerate(rows.ids[start:end])]
        duplicate = self._duplicates(payloads, ids) if src.has_ids else None
        texts: list[str] = []
        tokens: list[list[int]] = []
        for k, payload in enumerate(payloads):
            row, row_id = first + k, ids[k]
            if isinstance(payload, tuple):
                block.rejects.append(Reject(row, src.path, lines[k], row_id, payload[0], payload[1]))
                continue
            if duplicate is not None and duplicate[k]:
                block.rejects.append(
                    Reject(row, src.path, lines[k], row_id, "duplicate_id", f"id {row_id!r} appeared before")
                )
                continue
            block.ids.append(row_id)
            block.rows.append(row)
            block.lines.append(lines[k])
            (tokens if src.payload == "tokens" else texts).append(payload)
        if src.payload == "tokens":
            lengths = np.fromiter((len(t) for t in tokens), dtype=np.int32, count=len(tokens))
            flat = np.fromiter((v for t in tokens for v in t), dtype=np.int64, count=int(lengths.sum()))
            block.token_ids = (flat, lengths)
        else:
            block.texts = texts
        self._block_id += 1
        self.rows_read += end - start
        return block

    def _duplicates(self, payloads: list[Any], ids: list[Any]) -> list[bool]:
        """Per row: its id was seen before (an earlier block, or earlier in this block); remembers the rest.

        Rows already rejected for their payload take no part: their ids are neither checked nor kept.
        """
        valid = [k for k, payload in enumerate(payloads) if not isinstance(payload, tuple)]
        keys = np.fromiter((id_key(ids[k]) for k in valid), np.uint64, len(valid))
        repeated = self._seen.contains_many(keys)
        _, firsts = np.unique(keys, return_index=True)
        later = np.ones(len(keys), dtype=bool)
        later[firsts] = False
        repeated |= later  # the second and later rows with one id in this block
        self._seen.add_many(keys[~repeated])
        duplicate = np.zeros(len(payloads), dtype=bool)
        duplicate[valid] = repeated
        return duplicate.tolist()


class IdSet:
    """The ids seen so far, as 64-bit hashes: sorted numpy arrays plus a small set of recent ones.

    NOTE: 8 bytes a row instead of ~130 for a Python set of ints, so memory stays flat on files of
    millions of rows. Recent keys become a sorted chunk of `_MERGE_AT` keys, and `_FANIN` chunks one
    sorted run; neither is ever reallocated. Merging everything into one ever-growing array instead
    (a new, bigger array and its temporaries each time) fragmented the heap: glibc raises its mmap
    threshold to the size of the freed arrays, so later ones came from the heap and the reader alone
    grew by ~65 MiB over a million rows. Lookups are per block, vectorised (`contains_many`).
    """

    _MERGE_AT = 1 << 16
    _FANIN = 16
    _MASK = 0xFFFFFFFFFFFFFFFF

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []  # sorted uint64, about _MERGE_AT * _FANIN keys each
        self._chunks: list[np.ndarray] = []  # sorted uint64, about _MERGE_AT keys each
        self._recent: set[int] = set()

    def __contains__(self, key: int) -> bool:
        key &= self._MASK
        if key in self._recent:
            return True
        k = np.uint64(key)
        for keys in (*self._runs, *self._chunks):
            i = int(np.searchsorted(keys, k))
            if i < len(keys) and keys[i] == k:
                return True
        return False

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        """A bool per key (uint64): seen before."""
        found = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return found
        for sorted_keys in (*self._runs, *self._chunks):
            i = np.searchsorted(sorted_keys, keys)
            np.minimum(i, len(sorted_keys) - 1, out=i)
            found |= sorted_keys[i] == keys
        if self._recent:
            recent = self._recent
            found |= np.fromiter((k in recent for k in keys.tolist()), bool, len(keys))
        return found

    def add(self, key: int) -> None:
        self._recent.add(key & self._MASK)
        if len(self._recent) >= self._MERGE_AT:
            self._merge()

    def add_many(self, keys: np.ndarray) -> None:
        """Adds uint64 keys (none of them seen before)."""
        self._recent.update(keys.tolist())
        if len(self._recent) >= self._MERGE_AT:
            self._merge()

    def update(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.add(key)

    def _merge(self) -> None:
        chunk = np.fromiter(self._recent, np.uint64, len(self._recent))
        chunk.sort()
        self._chunks.append(chunk)
        self._recent.clear()
        if len(self._chunks) >= self._FANIN:
            run = np.concatenate(self._chunks)
            run.sort()
            self._runs.append(run)
            self._chunks = []


def id_key(row_id: Any) -> int:
    """What the duplicate check remembers of an id: 64 bits of blake2b over its type and value.

    NOTE: not Python's hash(): that one maps ints modulo 2**61 - 1, so large numeric ids collide.
    """
    text = f"{type(row_id).__name__}:{row_id!r}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _split_tail(data: bytes) -> tuple[bytes, bytes]:
    """(complete lines, the partial last line)."""
    cut = data.rfind(b"\n")
    return (data, b"") if cut < 0 and not data else (data[: cut + 1], data[cut + 1 :])


def _fast_text_check(values: pa.ChunkedArray | pa.Array) -> list[Any]:
    """Texts as Python strings, with null and blank ones replaced by reject reasons (vectorised test)."""
    texts = values.to_pylist()
    blank = pc.equal(pc.utf8_trim_whitespace(pc.fill_null(values, "")), "")
    for i in np.flatnonzero(blank.to_numpy(zero_copy_only=False)):
        texts[i] = _check_text(texts[i])
    return texts


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
