"""Crash-safe output: one atomic part per window, a manifest, and the final assembly.

Layout next to the output `OUT`:
  OUT.parts/part-000042.parquet   results of window 42 (ids + embeddings, input order)
  OUT.parts/rejects-000042.jsonl  that window's rejected rows (only when there are some)
  OUT.parts/chunk-000043-000.parquet  a checkpoint: rows of window 43 finished so far (--commit-every)
  OUT.parts/manifest.json         fingerprint + the windows committed so far, in order, and the
                                  checkpoints of windows not yet committed (`partial`)
Every file is written under a temporary name, fsynced and renamed, and the manifest is rewritten
the same way after each part, so a kill between any two instructions leaves a consistent prefix.
At the end the parts are assembled into OUT (and OUT.rejects.jsonl), again atomically.

A checkpoint holds a task's own table of finished rows of an open window; windows themselves stay
what they are (their rows, their sorting), so a resumed run re-reads a checkpointed window and
computes only what its checkpoints lack. Committing the window drops its checkpoints.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import OutputError
from ..models.checkpoint import weights_file
from .lock import LOCK_NAME

MANIFEST_VERSION = 1
_ASSEMBLE_BATCH_ROWS = 16_384  # rows per record batch when the parts are assembled


def parts_dir(output: str) -> Path:
    return Path(output + ".parts")


def rejects_path(output: str) -> Path:
    return Path(output + ".rejects.jsonl")


def has_commits(output: str) -> bool:
    """A readable manifest with at least one window or checkpoint: anything less is nothing committed."""
    try:
        data = json.loads((parts_dir(output) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("windows") or data.get("partial"))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Any) -> None:
    """write(tmp_path) then fsync and rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(f"cannot write ({exc.strerror or exc})", path=str(path)) from None


def _file_digest(path: str) -> str:
    """Size + the first and last MiB: cheap, and catches a changed or different file."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        if size > 1 << 20:
            fh.seek(max(size - (1 << 20), 1 << 20))
            h.update(fh.read())
    return h.hexdigest()[:16]


RAW_LINE = "_json_line"  # a table column of finished JSON lines: a JSONL part writes them as they are


def fingerprint(files: list[str], model_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """What must not change between a run and its resume."""
    weights = weights_file(model_dir)
    return {
        "inputs": [{"path": f, "digest": _file_digest(f)} for f in files],
        "model": {"path": str(model_dir), "weights": _file_digest(str(weights)) if weights else None},
        **options,
    }


def fingerprint_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key == "inputs":
                return "the input files differ from the interrupted run's"
            if key == "model":
                return f"the model differs (was {old.get(key, {}).get('path')}, now {new.get(key, {}).get('path')})"
            return f"option {key} differs (was {old.get(key)!r}, now {new.get(key)!r})"
    return None


class PartStore:
    """The parts directory of one output: commit windows, read the manifest, assemble the result."""

    def __init__(self, output: str, fmt: str, dim: int, fp: dict[str, Any]) -> None:
        self.output = output
        self.fmt = fmt
        self.dim = dim
        self.dir = parts_dir(output)
        self.fingerprint = fp
        self.windows: list[dict[str, Any]] = []
        self.partial: dict[int, dict[str, Any]] = {}  # window id -> its checkpoints (chunks, rows, facts)
        self.id_column = "id"  # the column `committed_ids` reads back

    # -- state -------------------------------------------------------------------------------------

    def committed(self) -> bool:
        return has_commits(self.output)

    def _read_manifest(self) -> dict[str, Any]:
        try:
            data = json.loads((self.dir / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def load(self) -> None:
        """Reads an interrupted run's manifest; refuses one made with other inputs or options."""
        data = self._read_manifest()
        diff = fingerprint_difference(data.get("fingerprint", {}), self.fingerprint)
        if diff:
            raise OutputError(f"cannot resume: {diff}; rerun with --overwrite to start over", path=self.output)
        self.windows = list(data.get("windows", []))
        done = len(self.windows)
        self.partial = {int(p["window"]): p for p in data.get("partial", []) if int(p["window"]) >= done}
        self._remove_unlisted_chunks()

    def _remove_unlisted_chunks(self) -> None:
        """Chunks no manifest lists: a kill between a chunk's rename and the manifest's, or after a
        window's commit and before its chunks were removed."""
        listed = {name for p in self.partial.values() for name in p["chunks"]}
        for path in self.dir.glob("chunk-*"):
            if path.name not in listed:
                path.unlink(missing_ok=True)

    def remove_stale_temporaries(self) -> None:
        """Temporary files a killed run left (a part or the output half written): this run holds the lock."""
        out = Path(self.output)
        names = [glob.escape(out.name), glob.escape(rejects_path(self.output).name)]
        stale = [path for name in names for path in out.parent.glob(f".{name}.tmp-*")]
        if self.dir.is_dir():
            stale += self.dir.glob(".*.tmp-*")
        for path in stale:
            with contextlib.suppress(OSError):
                path.unlink()

    def start_fresh(self) -> None:
        """An empty parts directory (but for the lock, which this run holds) and an empty manifest."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for entry in self.dir.iterdir():
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        self.windows = []
        self.partial = {}
        self._write_manifest()

    @property
    def rows_committed(self) -> int:
        """Input rows covered by committed windows (rejects included)."""
        return sum(w["input_rows"] for w in self.windows)

    @property
    def rows_written(self) -> int:
        return sum(w["rows"] for w in self.windows)

    @property
    def rows_checkpointed(self) -> int:
        """Rows finished in windows not yet committed, kept by checkpoints."""
        return sum(p["rows"] for p in self.partial.values())

    @property
    def rows_done(self) -> int:
        """What a kill now would keep: rows in committed windows and in checkpoints."""
        return self.rows_written + self.rows_checkpointed

    def committed_ids(self) -> Iterator[Any]:
        for w in self.windows:
            yield from self._read_part_ids(self.dir / w["part"])

    # -- checkpoints -------------------------------------------------------------------------------

    def checkpoint(self, chunks: list[tuple[int, pa.Table, dict[str, Any]]]) -> None:
        """Keeps finished rows of open windows: per window, a table of a task's own making and the
        facts its resume needs (they must not change between a window's chunks); one manifest write."""
        if not chunks:
            return
        for window_id, table, facts in chunks:
            entry = self.partial.setdefault(window_id, {"window": window_id, "chunks": [], "rows": 0, **facts})
            name = f"chunk-{window_id:06d}-{len(entry['chunks']):03d}.parquet"
            atomic_write(self.dir / name, lambda tmp, t=table: pq.write_table(t, tmp, compression="zstd"))
            entry["chunks"].append(name)
            entry["rows"] += table.num_rows
        self._write_manifest()

    def checkpointed(self, window_id: int) -> tuple[pa.Table, dict[str, Any]] | None:
        """A window's checkpointed rows (its chunks, concatenated) and its facts; None without any."""
        entry = self.partial.get(window_id)
        if entry is None:
            return None
        tables = [pq.read_table(self.dir / name) for name in entry["chunks"]]
        facts = {k: v for k, v in entry.items() if k not in ("window", "chunks", "rows")}
        return pa.concat_tables(tables), facts

    # -- commit ------------------------------------------------------------------------------------

    def commit(
        self,
        window_id: int,
        first_row: int,
        input_rows: int,
        ids: list[Any],
        values: np.ndarray,
        rejects: list[dict[str, Any]],
        meta: dict[str, list[Any]] | None = None,
    ) -> None:
        """Commits a window of per-row vectors; `meta`: per-row facts a task's own part format needs
        (OpenAI embedding answers: each request's options, row and token count)."""
        self._commit(
            window_id,
            first_row,
            input_rows,
            len(ids),
            lambda tmp: self._write_part(tmp, ids, values, meta, rejects),
            rejects,
        )

    def commit_table(
        self,
        window_id: int,
        first_row: int,
        input_rows: int,
        table: pa.Table,
        rejects: list[dict[str, Any]],
        answered: int | None = None,
    ) -> None:
        """Commits a window whose results are any Arrow table (generation rows, for one); `answered`:
        the rows written, where the table also holds lines for rejected rows (OpenAI batch errors)."""

        def write(tmp: Path) -> None:
            if self.fmt == "parquet":
                pq.write_table(table, tmp, compression="zstd")
            elif RAW_LINE in table.column_names:  # rows already JSON, each exactly as its task wrote it
                tmp.write_text("".join(line + "\n" for line in table.column(RAW_LINE).to_pylist()), encoding="utf-8")
            else:
                write_jsonl_rows(tmp, table.to_pylist())

        self._commit(window_id, first_row, input_rows, table.num_rows if answered is None else answered, write, rejects)

    def _commit(
        self, window_id: int, first_row: int, input_rows: int, rows: int, write: Any, rejects: list[dict[str, Any]]
    ) -> None:
        part = f"part-{window_id:06d}.{'parquet' if self.fmt == 'parquet' else 'jsonl'}"
        atomic_write(self.dir / part, write)
        entry = {
            "window": window_id,
            "first_row": first_row,
            "input_rows": input_rows,
            "rows": rows,
            "rejects": len(rejects),
            "part": part,
        }
        if rejects:
            entry["rejects_part"] = f"rejects-{window_id:06d}.jsonl"
            atomic_write(self.dir / entry["rejects_part"], lambda tmp: write_jsonl_rows(tmp, rejects))
        self.windows.append(entry)
        dropped = self.partial.pop(window_id, None)
        self._write_manifest()
        for name in dropped["chunks"] if dropped else []:  # NOTE: only once the manifest no longer lists them
            (self.dir / name).unlink(missing_ok=True)

    def _write_manifest(self) -> None:
        data: dict[str, Any] = {"version": MANIFEST_VERSION, "fingerprint": self.fingerprint, "windows": self.windows}
        if self.partial:
            data["partial"] = [self.partial[w] for w in sorted(self.partial)]
        atomic_write(self.dir / "manifest.json", lambda tmp: tmp.write_text(json.dumps(data), encoding="utf-8"))

    def _write_part(
        self, tmp: Path, ids: list[Any], values: np.ndarray, meta: dict[str, list[Any]] | None, rejects: list[Any]
    ) -> None:
        """A window's part file; `meta` and `rejects` are there for a task whose part shows them
        (OpenAI answers write an error line per rejected request)."""
        if self.fmt == "parquet":
            pq.write_table(results_table(ids, values, self.dim), tmp, compression="zstd")
        else:
            rows = ({"id": i, "embedding": v} for i, v in zip(ids, values.tolist(), strict=True))
            write_jsonl_rows(tmp, rows)

    def _read_part_ids(self, path: Path) -> list[Any]:
        if self.fmt == "parquet":
            return pq.read_table(path, columns=[self.id_column]).column(self.id_column).to_pylist()
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line)[self.id_column] for line in fh]

    # -- assembly ----------------------------------------------------------------------------------

    def assemble(self) -> None:
        """Parts -> the final output (and rejects file), atomically; then the parts go.

        NOTE: the output's rename is the commit point. The manifest is removed first after it, so a
        kill while the directory is being removed leaves a manifest-less one: nothing to resume.
        """
        atomic_write(Path(self.output), self._concat_parts)
        rejects = [self.dir / w["rejects_part"] for w in self.windows if "rejects_part" in w]
        if rejects:
            atomic_write(rejects_path(self.output), lambda tmp: _concat_bytes(tmp, rejects))
        with contextlib.suppress(OSError):
            (self.dir / "manifest.json").unlink()
        shutil.rmtree(self.dir, ignore_errors=True)

    def empty_schema(self) -> pa.Schema:
        """The output's schema; a task whose rows are not embeddings says its own."""
        return results_table([], np.zeros((0, self.dim), np.float32), self.dim).schema

    def _concat_parts(self, tmp: Path) -> None:
        parts = [self.dir / w["part"] for w in self.windows]
        if self.fmt != "parquet":
            _concat_bytes(tmp, parts)
            return
        schema = _unified_schema(parts, self.empty_schema())
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for part in parts:
                # NOTE: streamed a record batch at a time, single-threaded: reading a whole part
                # (multi-threaded decode) costs a transient RSS spike of several times its size at
                # the very end of the run, which is where the run's peak would otherwise be.
                source = pq.ParquetFile(part)
                try:
                    for batch in source.iter_batches(batch_size=_ASSEMBLE_BATCH_ROWS, use_threads=False):
                        writer.write_table(pa.Table.from_batches([batch]).cast(schema))
                finally:
                    source.close()


def _unified_schema(parts: list[Path], schema: pa.Schema) -> pa.Schema:
    """One schema for every part: ids are integers where every part's are, else text.

    A part's id type follows its own rows (integers, strings, all-null, or an empty part), so
    parts of one run can differ; their footers say how, without reading the data.
    """
    kinds = set()
    for part in parts:
        meta = pq.read_metadata(part)
        if meta.num_rows:
            kinds.add(meta.schema.to_arrow_schema().field("id").type)
    kinds.discard(pa.null())
    id_type = kinds.pop() if len(kinds) == 1 else pa.string()
    return schema.set(schema.get_field_index("id"), pa.field("id", id_type))


def results_table(ids: list[Any], values: np.ndarray, dim: int) -> pa.Table:
    flat = pa.array(values.reshape(-1), type=pa.float32())
    return pa.table({"id": id_array(ids), "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)})


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


def _concat_bytes(tmp: Path, parts: list[Path]) -> None:
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 20)
