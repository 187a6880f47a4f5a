"""Stage 1, read: input files -> RowBlocks, streamed.

Accepts JSONL, Parquet and OpenAI-style batch JSONL (`custom_id`, `body.input`); one file, several,
a directory or a glob of shards. Whole-input problems (missing file, unknown column, unreadable
file) are raised up front as InputError. A bad row becomes a Reject and the run goes on.

Blocks never straddle a window boundary (a multiple of `window_rows` input rows), so windows are
the same in every run over the same input, which is what makes resume exact.

Every input row is counted per file (`Reader.counts`): JSONL lines that are not blank, Parquet rows
(checked against the footer). A file read to its end must have given all of its bytes (JSONL) or
all of its rows (Parquet) to the reader, or the run fails naming it: a row is never lost unseen.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pj

from ..config import InputConfig
from ..files.ids import IdSet, check_id, id_key
from ..files.row_source import Segment, jsonl_chunks, parquet_batches
from ..files.row_values import (
    Rows,
    arrow_ids,
    arrow_texts,
    check_image,
    check_prompts,
    check_text,
    check_tokens,
    duplicate_reason,
    pair_payload,
)
from ..files.sources import TOKENS_COLUMN, Source, check_id_columns, expand_paths, is_id_type, open_source, read_schema
from ..types import Reject, RowBlock
from .requests import Request, parse_request
from .types import RequestPart


@dataclass(slots=True)
class SourceRows:
    """What the reader saw of one input file."""

    path: str
    read: int = 0  # input rows taken from the file (blank JSONL lines are not rows), resumed ones included
    resumed: int = 0  # of which committed by an interrupted run, so skipped


class Reader:
    """Produces RowBlocks of at most `read_block_rows` input rows, never crossing a window edge.

    `skip_rows` input rows are skipped (resume). Without an id column, ids are the global input row
    numbers; with one, a row's id is a string, an integer or null (absent), and a repeated id is a
    reject (`remember_ids` adds the ids already written, on resume). Null ids are never repeats.
    """

    name = "read"

    def __init__(self, cfg: InputConfig, window_rows: int, skip_rows: int = 0) -> None:
        self.cfg = cfg
        self.window_rows = window_rows
        self.sources = [open_source(p, cfg) for p in expand_paths(cfg.paths)]
        check_id_columns(self.sources, cfg.id_column)
        self.skip_rows = skip_rows
        self.skip_done = 0
        self.rows_read = 0  # input rows consumed, rejects and skipped rows included
        self.counts: dict[str, SourceRows] = {s.path: SourceRows(s.path) for s in self.sources}
        self._block_id = 0
        self._seen = IdSet()
        self._names: dict[str, list[str]] = {}  # a Parquet file's column names (its prompt column)

    def remember_ids(self, ids: Iterable[Any]) -> None:
        """Ids already written by an interrupted run: a repeat of one is a duplicate."""
        self._seen.update(id_key(i) for i in ids if i is not None)

    def produce(self) -> Iterator[RowBlock]:
        limit = self.cfg.limit
        for src in self.sources:
            file_first_row = self.rows_read
            for rows in self._chunks(src):
                for block in self._blocks(src, rows, file_first_row):
                    yield block
                    if limit is not None and self.rows_read >= self.skip_done + limit:
                        return

    # -- chunking: each yields parsed rows in bounded chunks --------------------------------------

    def _chunks(self, src: Source, seg: Segment | None = None) -> Iterator[Rows]:
        """The file's rows (or the segment's), parsed, in bounded chunks (row_source.py reads them)."""
        if src.fmt == "parquet":
            batches = parquet_batches(src.path, self.cfg.read_block_rows, self._parquet_columns(src), seg)
            yield from (self._parquet_rows(src, batch) for batch in batches)
        else:
            lines = jsonl_chunks(src.path, self.cfg.read_chunk_bytes, seg)
            yield from (self._parse_lines(src, numbered) for numbered in lines)

    def _parquet_columns(self, src: Source) -> list[str]:
        if src.payload == "pair":
            return [*self.cfg.pair_columns] + ([self.cfg.id_column] if src.has_ids else [])
        payload_col = {"text": self.cfg.text_column, "image": self.cfg.image_column}.get(src.payload, TOKENS_COLUMN)
        columns = [payload_col] + ([self.cfg.id_column] if src.has_ids else [])
        prompt = self.cfg.prompt_column
        if prompt and src.payload == "text" and prompt not in columns and prompt in self._schema_names(src):
            columns.append(prompt)
        return columns

    def _schema_names(self, src: Source) -> list[str]:
        if src.path not in self._names:
            self._names[src.path] = read_schema(src.path).names
        return self._names[src.path]

    def _parquet_rows(self, src: Source, batch: pa.RecordBatch) -> Rows:
        """One record batch of a Parquet file -> parsed rows."""
        rows = Rows()
        values = batch.column(self._parquet_columns(src)[0])
        if src.payload == "pair":
            first, second = (batch.column(c).to_pylist() for c in self.cfg.pair_columns)
            rows.payloads = [pair_payload(a, b, self.cfg.pair_columns) for a, b in zip(first, second, strict=True)]
        elif src.payload == "text":
            rows.payloads = arrow_texts(values)
        elif src.payload == "image":
            rows.payloads = [v if (bad := check_image(v)) is None else bad for v in values.to_pylist()]
        else:
            rows.payloads = [v if (bad := check_tokens(v)) is None else bad for v in values.to_pylist()]
        rows.ids = arrow_ids(batch.column(self.cfg.id_column)) if src.has_ids else [None] * batch.num_rows
        rows.lines = [None] * batch.num_rows
        prompt = self.cfg.prompt_column
        if prompt and src.payload == "text" and prompt in batch.schema.names:
            rows.prompts = batch.column(prompt).to_pylist()
            check_prompts(rows)
        return rows

    def _parse_lines(self, src: Source, numbered: list[tuple[int, bytes]]) -> Rows:
        rows = Rows()
        if src.fmt == "jsonl" and src.payload == "text":
            fast = self._fast_jsonl(numbered)
            if fast is not None:
                return fast
        prompt = self.cfg.prompt_column if src.payload == "text" else None
        if prompt:
            rows.prompts = []
        for line_no, raw in numbered:
            rows.lines.append(line_no)
            payload, row_id, obj = self._parse_line(src, raw)
            rows.payloads.append(payload)
            rows.ids.append(row_id)
            if rows.prompts is not None:
                rows.prompts.append(obj.get(prompt) if obj is not None else None)
        if rows.prompts is not None:
            check_prompts(rows)
        return rows

    def _fast_jsonl(self, numbered: list[tuple[int, bytes]]) -> Rows | None:
        """pyarrow parses a clean chunk in one call; any problem falls back to line by line."""
        text_col, id_col = self.cfg.text_column, self.cfg.id_column
        data = b"\n".join(raw for _, raw in numbered)
        try:
            table = pj.read_json(
                io.BytesIO(data),
                read_options=pj.ReadOptions(block_size=min(len(data) + 1, 1 << 30)),
                parse_options=pj.ParseOptions(
                    explicit_schema=pa.schema([(text_col, pa.string())]), unexpected_field_behavior="infer"
                ),
            )
        except (pa.ArrowException, UnicodeDecodeError, ValueError):
            return None
        if table.num_rows != len(numbered):
            return None
        has_ids = id_col in table.column_names
        if has_ids and not is_id_type(table.schema.field(id_col).type):
            return None  # floats, lists, objects, integers beyond 64 bits: each row says what is wrong
        rows = Rows()
        try:  # NOTE: pyarrow does not validate UTF-8 while parsing; converting does
            rows.payloads = arrow_texts(table.column(text_col))
            rows.ids = table.column(id_col).to_pylist() if has_ids else [None] * table.num_rows
            prompt = self.cfg.prompt_column
            if prompt and prompt in table.column_names:
                rows.prompts = table.column(prompt).to_pylist()
                check_prompts(rows)
        except UnicodeDecodeError:
            return None
        rows.lines = [n for n, _ in numbered]
        return rows

    def _parse_line(self, src: Source, raw: bytes) -> tuple[Any, Any, dict[str, Any] | None]:
        """(payload or reject, id, the row's JSON object when it is one)."""
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return ("invalid_utf8", f"not UTF-8 ({exc.reason} at byte {exc.start})"), None, None
        except ValueError as exc:
            return ("malformed_json", f"not valid JSON ({exc})"), None, None
        if not isinstance(obj, dict):
            return ("malformed_json", f"a JSON {type(obj).__name__}, not an object"), None, None
        if src.fmt == "openai":  # NOTE: a score run (its pair columns set) answers score and rerank bodies
            return parse_request(obj, bool(self.cfg.pair_columns)), obj.get("custom_id"), obj
        row_id = obj.get(self.cfg.id_column)
        if src.payload == "pair":
            first, second = (obj.get(c) for c in self.cfg.pair_columns)
            return pair_payload(first, second, self.cfg.pair_columns), row_id, obj
        if src.payload == "tokens":
            value = obj.get(TOKENS_COLUMN)
            return (value if (bad := check_tokens(value)) is None else bad), row_id, obj
        if src.payload == "image":
            value = obj.get(self.cfg.image_column)
            return (value if (bad := check_image(value)) is None else bad), row_id, obj
        value = obj.get(self.cfg.text_column)
        return (value if (bad := check_text(value)) is None else bad), row_id, obj

    # -- blocks ----------------------------------------------------------------------------------

    def _blocks(self, src: Source, rows: Rows, file_first_row: int) -> Iterator[RowBlock]:
        n = len(rows.payloads)
        start = 0
        count = self.counts[src.path]
        if self.skip_rows:  # resume: drop input rows already committed
            start = min(n, self.skip_rows)
            self.skip_rows -= start
            self.skip_done += start
            self.rows_read += start
            count.read += start
            count.resumed += start
        while start < n:
            room = self.window_rows - self.rows_read % self.window_rows
            end = min(n, start + self.cfg.read_block_rows, start + room)
            if self.cfg.limit is not None:
                end = min(end, start + self.skip_done + self.cfg.limit - self.rows_read)
            count.read += end - start
            yield self._block(src, rows, start, end, file_first_row)
            start = end

    def _block(self, src: Source, rows: Rows, start: int, end: int, file_first_row: int) -> RowBlock:
        first = self.rows_read
        block = RowBlock(self._block_id, first, end - start, src.path, [], file_first_row=file_first_row)
        payloads, lines = rows.payloads[start:end], rows.lines[start:end]
        ids = rows.ids[start:end] if src.has_ids else list(range(first, first + end - start))
        for k, row_id in enumerate(ids):
            if not isinstance(payloads[k], tuple) and (bad := check_id(row_id)) is not None:
                payloads[k] = bad  # a valid payload under an id that cannot be written
        duplicate = self._duplicates(payloads, ids) if src.has_ids else None
        texts: list[str] = []
        tokens: list[list[int]] = []
        images: list[Any] = []
        options: list[RequestPart] = []
        row_prompts = rows.prompts[start:end] if rows.prompts is not None else None
        prompts: list[str | None] = []
        for k, payload in enumerate(payloads):
            row, row_id = first + k, ids[k]
            if isinstance(payload, tuple) or (duplicate is not None and duplicate[k]):
                reason, message = payload if isinstance(payload, tuple) else duplicate_reason(row_id)
                shown_id = row_id if check_id(row_id) is None else repr(row_id)
                block.rejects.append(Reject(row, src.path, lines[k], shown_id, reason, message, row - file_first_row))
                continue
            # NOTE: a request fans out into consecutive rows under its one input row number (RequestPart)
            parts = payload.parts if isinstance(payload, Request) else [payload]
            for index, part in enumerate(parts):
                block.ids.append(row_id)
                block.rows.append(row)
                block.lines.append(lines[k])
                {"tokens": tokens, "image": images}.get(src.payload, texts).append(part)
                if row_prompts is not None:
                    prompts.append(row_prompts[k])
                if isinstance(payload, Request):
                    options.append(RequestPart(payload.options, index, len(parts)))
        if src.payload == "tokens":
            lengths = np.fromiter((len(t) for t in tokens), dtype=np.int32, count=len(tokens))
            flat = np.fromiter((v for t in tokens for v in t), dtype=np.int64, count=int(lengths.sum()))
            block.token_ids = (flat, lengths)
        elif src.payload == "image":
            block.images = images
        else:
            block.texts = texts
            block.prompts = prompts if row_prompts is not None else None
        if src.fmt == "openai":
            block.options = options
        self._block_id += 1
        self.rows_read += end - start
        return block

    def _duplicates(self, payloads: list[Any], ids: list[Any]) -> list[bool]:
        """Per row: its id was seen before (an earlier block, or earlier in this block); remembers the rest.

        Rows already rejected (payload or id) and rows without an id take no part: they are neither
        checked nor kept.
        """
        valid = [k for k, payload in enumerate(payloads) if not isinstance(payload, tuple) and ids[k] is not None]
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
