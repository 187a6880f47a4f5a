"""Input sources: paths and globs expanded; each file's format, columns and id kind found up front;
row counts estimated for progress."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..config import InputConfig
from ..errors import InputError
from . import storage
from .lines import BOM, LineSplitter

_SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}


TOKENS_COLUMN = "input_ids"


@dataclass(frozen=True, slots=True)
class Source:
    path: str
    fmt: str  # jsonl | parquet | openai
    payload: str  # "text", "tokens" or "pair" (two text columns: --pair-columns)
    has_ids: bool


def expand_paths(specs: tuple[str, ...]) -> list[str]:
    """Files, directories (their data files, sorted) and globs -> a list of files, in order; a URI
    (`s3://bucket/shards/*.parquet`, a prefix, an object) the same way, its files as URIs."""
    files: list[str] = []
    for spec in specs:
        if storage.is_remote(spec):
            files.extend(_expand_uri(spec))
            continue
        spec = storage.local_path(spec)
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


def _expand_uri(spec: str) -> list[str]:
    try:
        found = storage.expand(spec)
    except storage.errors() as exc:
        raise InputError(f"cannot list ({storage.failure(exc)})", path=storage.shown(spec)) from None
    if found is None:
        raise InputError("no such object or prefix", path=storage.shown(spec))
    if _is_single(spec, found):
        data = found
    else:  # NOTE: names starting with _ or . are a dataset's own files (manifests, rejects): skipped, as pyarrow does
        data = [
            p for p in found if Path(p).suffix.lower() in _SUFFIX_FORMATS and not Path(p).name.startswith(("_", "."))
        ]
    if not data:
        raise InputError(
            "no file matches this pattern" if "*" in spec else "holds no .jsonl or .parquet file",
            path=storage.shown(spec),
        )
    return data


def _is_single(spec: str, found: list[str]) -> bool:
    """The URI named one object (not a prefix or a pattern): taken whatever its suffix, as a local file is."""
    return len(found) == 1 and not any(ch in spec for ch in "*?[") and found[0].rstrip("/") == spec.rstrip("/")


def read_schema(path: str) -> pa.Schema:
    """A Parquet file's schema, from its footer (a ranged read on a store)."""
    if not storage.is_remote(path):
        return pq.read_schema(path)
    with storage.open_binary(path) as fh:
        return pq.read_schema(fh)


def parquet_rows(path: str) -> int:
    if not storage.is_remote(path):
        return pq.ParquetFile(path).metadata.num_rows
    with storage.open_binary(path) as fh:
        return pq.ParquetFile(fh).metadata.num_rows


def json_objects(path: str, limit: int = 1000) -> list[dict]:
    """The JSON objects among the first `limit` lines (bad lines are the rows' problem, not the file's)."""
    found = []
    try:
        with storage.open_binary(path, block_size=1 << 20) as fh:
            for n, line in enumerate(fh):
                if n >= limit:
                    break
                if n == 0 and line.startswith(BOM):
                    line = line[len(BOM) :]
                try:
                    obj = json.loads(line) if line.strip() else None
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    found.append(obj)
    except storage.errors() as exc:
        raise InputError(f"cannot read file ({storage.failure(exc)})", path=storage.shown(path)) from None
    return found


def is_batch_line(obj: dict) -> bool:
    """A line of an OpenAI-style batch file (`custom_id` and a `body` object)."""
    return "custom_id" in obj and isinstance(obj.get("body"), dict)


def is_openai_input(cfg: InputConfig) -> bool:
    """The run reads an OpenAI batch file: `--input-format openai`, or a first JSONL file of batch lines."""
    if cfg.input_format == "openai":
        return True
    if cfg.input_format != "auto":
        return False
    try:
        files = expand_paths(cfg.paths)
    except InputError:
        return False  # NOTE: the reader says what is wrong with the paths, in its own words
    if not files or files[0].lower().endswith((".parquet", ".pq")):
        return False
    objects = json_objects(files[0], limit=10)
    return bool(objects) and is_batch_line(objects[0])


def is_text_type(kind: pa.DataType) -> bool:
    """Text as Parquet writers store it: plain, large, view, or dictionary-encoded (pandas 'category')."""
    if pa.types.is_dictionary(kind):
        return is_text_type(kind.value_type)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def is_id_type(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return is_id_type(kind.value_type)
    return is_text_type(kind) or pa.types.is_integer(kind) or pa.types.is_null(kind)


def open_source(path: str, cfg: InputConfig) -> Source:
    """Detects the format and checks the columns of one file."""
    fmt = cfg.input_format
    if fmt == "auto":
        fmt = _SUFFIX_FORMATS.get(Path(path).suffix.lower(), "")
        if not fmt:
            raise InputError("unknown file type (expected .jsonl or .parquet; see --input-format)", path=path)
    objects = json_objects(path) if fmt in ("jsonl", "openai") else []
    if fmt == "jsonl" and objects and is_batch_line(objects[0]):
        fmt = "openai"
    if fmt == "openai":
        return Source(path, "openai", "text", True)
    if cfg.pair_columns:
        return _pair_source(path, fmt, cfg, objects)
    if cfg.image_column:
        return _image_source(path, fmt, cfg, objects)
    if fmt == "parquet":
        try:
            schema = read_schema(path)
        except pa.ArrowException as exc:
            raise InputError(f"not a readable Parquet file ({exc})", path=storage.shown(path)) from None
        except storage.errors() as exc:
            raise InputError(
                f"not a readable Parquet file ({storage.failure(exc)})", path=storage.shown(path)
            ) from None
        columns = set(schema.names)
        if cfg.id_column in columns and not is_id_type(kind := schema.field(cfg.id_column).type):
            raise InputError(f"id column '{cfg.id_column}' holds {kind}; ids must be strings or integers", path=path)
    else:
        columns = {key for obj in objects for key in obj}
    if fmt == "jsonl" and (not objects or cfg.text_column in columns):
        return Source(path, fmt, "text", cfg.id_column in columns)  # a row lacking text becomes a reject
    if cfg.text_column in columns:
        kind = schema.field(cfg.text_column).type if fmt == "parquet" else pa.string()
        if not is_text_type(kind):
            raise InputError(f"column '{cfg.text_column}' holds {kind}, not text", path=path)
        return Source(path, fmt, "text", cfg.id_column in columns)
    if TOKENS_COLUMN in columns:
        return Source(path, fmt, "tokens", cfg.id_column in columns)
    shown = ", ".join(sorted(columns)[:8])
    raise InputError(f"no column '{cfg.text_column}' (nor '{TOKENS_COLUMN}'); columns are: {shown}", path=path)


def _image_source(path: str, fmt: str, cfg: InputConfig, objects: list[dict]) -> Source:
    """A file of image references (--image-column): paths or URIs as text, or bytes (Parquet binary)."""
    column = cfg.image_column

    def absent(names: list[str]) -> InputError:
        return InputError(f"no column '{column}' (--image-column); columns are: {', '.join(names[:8])}", path=path)

    if fmt == "parquet":
        schema = read_schema(path)
        if column not in schema.names:
            raise absent(schema.names)
        kind = schema.field(column).type
        if not (is_text_type(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
            raise InputError(f"column '{column}' holds {kind}, not image paths or bytes", path=path)
        return Source(path, fmt, "image", cfg.id_column in schema.names)
    columns = {key for obj in objects for key in obj}
    if objects and column not in columns:
        raise absent(sorted(columns))
    return Source(path, fmt, "image", cfg.id_column in columns)


def _pair_source(path: str, fmt: str, cfg: InputConfig, objects: list[dict]) -> Source:
    """A file of text pairs: both columns present (Parquet: as text); a JSONL row lacking one is a reject."""
    if fmt == "parquet":
        schema = read_schema(path)
        for column in cfg.pair_columns:
            if column not in schema.names:
                raise InputError(f"no column '{column}' (--pair-columns {','.join(cfg.pair_columns)})", path=path)
            if not is_text_type(kind := schema.field(column).type):
                raise InputError(f"column '{column}' holds {kind}, not text", path=path)
        return Source(path, fmt, "pair", cfg.id_column in schema.names)
    return Source(path, fmt, "pair", any(cfg.id_column in obj for obj in objects))


def check_id_columns(sources: list[Source], id_column: str) -> None:
    """Ids come from every file or from none: row numbers of one file would pass for ids of another."""
    with_ids = [s.path for s in sources if s.has_ids]
    without = [s.path for s in sources if not s.has_ids]
    if with_ids and without:
        raise InputError(
            f"has no id column '{id_column}' but {with_ids[0]} has one: give every input file ids, or none",
            path=without[0],
        )


EXACT_COUNT_BYTES = 64 << 20  # a JSONL file up to this size has its rows counted (0.3 s at most), not estimated
REMOTE_EXACT_COUNT_BYTES = 8 << 20  # on a store, where counting means downloading it once more
STRATA, SAMPLE_BYTES = 16, 1 << 20  # a larger one: each sixteenth's line size from a 1 MiB sample of it


def estimate_rows(sources: list[Source]) -> int | None:
    """The progress total: exact for Parquet (footer) and for JSONL files up to EXACT_COUNT_BYTES
    (their non-blank lines, counted as the reader counts them); a larger JSONL file is estimated
    from the line sizes of samples spread over it (its first MiB alone can be unlike the rest)."""
    return sum(_estimate(src.path, src.fmt == "parquet") for src in sources)


def estimate_file_rows(paths: list[str]) -> int:
    """As `estimate_rows`, for files named by path (a Parquet file is known by its suffix)."""
    return sum(_estimate(p, _SUFFIX_FORMATS.get(Path(p).suffix.lower()) == "parquet") for p in paths)


def _estimate(path: str, parquet: bool) -> int:
    if parquet:
        return parquet_rows(path)
    size = storage.size(path)
    with storage.open_binary(path, block_size=SAMPLE_BYTES) as fh:
        if size <= (REMOTE_EXACT_COUNT_BYTES if storage.is_remote(path) else EXACT_COUNT_BYTES):
            splitter = LineSplitter(fh, 8 << 20)
            for _ in splitter.chunks():
                pass
            return splitter.rows
        rows = 0.0
        for k in range(STRATA):  # NOTE: stratified: a file sorted by length has short lines first
            start, end = size * k // STRATA, size * (k + 1) // STRATA
            n = min(SAMPLE_BYTES, end - start)
            fh.seek(start + (end - start - n) // 2)  # the middle of its stratum
            sample = fh.read(n)
            rows += (end - start) * sample.count(b"\n") / max(len(sample), 1)
    return max(round(rows), 1)
