"""Crash-safe output: one immutable part per window, a manifest, and the final assembly.

Layout next to the output `OUT` (a local path, or a URI on an object store):
  OUT.parts/part-000042.parquet   results of window 42 (ids + embeddings, input order)
  OUT.parts/rejects-000042.jsonl  that window's rejected rows (only when there are some)
  OUT.parts/chunk-000043-000.parquet  a checkpoint: rows of window 43 finished so far (--commit-every)
  OUT.parts/manifest.json         fingerprint + the windows committed so far, in order, and the
                                  checkpoints of windows not yet committed (`partial`)
Each part is written whole before the manifest names it, and the manifest is the commit point, so
a kill between any two instructions leaves a consistent prefix. How a part and a manifest become
durable is the folder's (folder.py: rename on a local disk, conditional puts on an object store).
At the end the parts are assembled into OUT (and OUT.rejects.jsonl); what a part holds and how
parts join is part_format.py's, the resume fingerprint fingerprint.py's.

A checkpoint holds a task's own table of finished rows of an open window; windows themselves stay
what they are (their rows, their sorting), so a resumed run re-reads a checkpointed window and
computes only what its checkpoints lack. Committing the window drops its checkpoints.

`TableStore` is the part store of a task whose window becomes its own table (labels, token
labels, sparse vectors), written as Parquet or JSONL like every part.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import OutputError
from .fingerprint import fingerprint_difference
from .folder import Folder, folder_for, parts_location, rejects_location
from .part_format import RAW_LINE, concat_bytes, concat_parquet, opened, results_table, write_jsonl_rows, write_parquet

MANIFEST_VERSION = 1


def parts_dir(output: str) -> Path:
    """A local output's parts directory (the server's batches, which are local, read it)."""
    return Path(parts_location(output))


def rejects_path(output: str) -> str:
    return rejects_location(output)


def has_commits(output: str) -> bool:
    """A readable manifest with at least one window or checkpoint: anything less is nothing committed."""
    return _lists_commits(folder_for(output).read_manifest())


def _lists_commits(manifest: dict[str, Any]) -> bool:
    """A manifest of an unfinished run with at least one window or checkpoint committed."""
    return bool(manifest.get("windows") or manifest.get("partial")) and not manifest.get("complete")


class PartStore:
    """The parts directory of one output: commit windows, read the manifest, assemble the result."""

    ragged: Any = None  # a head's values.RaggedSpec where a row's values are ragged items; None: dense rows

    def __init__(self, output: str, fmt: str, dim: int, fp: dict[str, Any]) -> None:
        self.output = output
        self.fmt = fmt
        self.dim = dim
        self.folder: Folder = folder_for(output)
        self.dataset = getattr(self.folder, "dataset", False)
        self.aux = "_" if self.dataset else ""  # NOTE: a dataset's other files start with _: readers skip them
        self.fingerprint = fp
        self.windows: list[dict[str, Any]] = []
        self.partial: dict[int, dict[str, Any]] = {}  # window id -> its checkpoints (chunks, rows, facts)
        self.id_column = "id"  # the column `committed_ids` reads back
        self.on_commit: Callable[[dict[str, Any]], None] | None = None  # told of each window committed

    # -- state -------------------------------------------------------------------------------------

    def committed(self) -> bool:
        return _lists_commits(self.folder.read_manifest())

    def nothing_to_keep(self) -> bool:
        """The parts folder holds nothing a run should keep: no commits, no finished dataset (whose
        folder is the output itself), no objects of anyone else's."""
        data = self.folder.read_manifest()
        kept = data.get("windows") or data.get("partial") or data.get("complete")
        return not kept and not self.folder.has_foreign_objects()

    def load(self) -> None:
        """Reads an interrupted run's manifest; refuses one made with other inputs or options."""
        data = self.folder.read_manifest()
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
        for name in self.folder.names(f"{self.aux}chunk-*"):
            if name not in listed:
                self.folder.delete(name)

    def remove_stale_temporaries(self) -> None:
        """Temporary files a killed run left (a part or the output half written): this run holds the lock."""
        self.folder.remove_stale_temporaries(self.output)

    def start_fresh(self) -> None:
        """An empty parts folder (but for the lock, which this run holds) and an empty manifest."""
        self.folder.clear()
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
            yield from self._read_part_ids(w["part"])

    # -- checkpoints -------------------------------------------------------------------------------

    def checkpoint(self, chunks: list[tuple[int, pa.Table, dict[str, Any]]]) -> None:
        """Keeps finished rows of open windows: per window, a table of a task's own making and the
        facts its resume needs (they must not change between a window's chunks); one manifest write."""
        if not chunks:
            return
        for window_id, table, facts in chunks:
            entry = self.partial.setdefault(window_id, {"window": window_id, "chunks": [], "rows": 0, **facts})
            name = f"{self.aux}chunk-{window_id:06d}-{len(entry['chunks']):03d}.parquet"
            self.folder.write(name, lambda tmp, t=table: write_parquet(t, tmp))
            entry["chunks"].append(name)
            entry["rows"] += table.num_rows
        self._write_manifest()

    def checkpointed(self, window_id: int) -> tuple[pa.Table, dict[str, Any]] | None:
        """A window's checkpointed rows (its chunks, concatenated) and its facts; None without any."""
        entry = self.partial.get(window_id)
        if entry is None:
            return None
        tables = [self._read_table(name) for name in entry["chunks"]]
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
                write_parquet(table, tmp)
            elif RAW_LINE in table.column_names:  # rows already JSON, each exactly as its task wrote it
                tmp.write_text("".join(line + "\n" for line in table.column(RAW_LINE).to_pylist()), encoding="utf-8")
            else:
                write_jsonl_rows(tmp, table.to_pylist())

        self._commit(window_id, first_row, input_rows, table.num_rows if answered is None else answered, write, rejects)

    def _commit(
        self, window_id: int, first_row: int, input_rows: int, rows: int, write: Any, rejects: list[dict[str, Any]]
    ) -> None:
        part = f"part-{window_id:06d}.{'parquet' if self.fmt == 'parquet' else 'jsonl'}"
        self.folder.write(part, write)
        entry = {
            "window": window_id,
            "first_row": first_row,
            "input_rows": input_rows,
            "rows": rows,
            "rejects": len(rejects),
            "part": part,
        }
        if rejects:
            entry["rejects_part"] = f"{self.aux}rejects-{window_id:06d}.jsonl"
            self.folder.write(entry["rejects_part"], lambda tmp: write_jsonl_rows(tmp, rejects))
        self.windows.append(entry)
        dropped = self.partial.pop(window_id, None)
        self._write_manifest()
        for name in dropped["chunks"] if dropped else []:  # NOTE: only once the manifest no longer lists them
            self.folder.delete(name)
        if self.on_commit is not None:
            self.on_commit(entry)

    def _manifest(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": MANIFEST_VERSION, "fingerprint": self.fingerprint, "windows": self.windows}
        if self.partial:
            data["partial"] = [self.partial[w] for w in sorted(self.partial)]
        return data

    def _write_manifest(self) -> None:
        self.folder.write_manifest(self._manifest())

    def _read_table(self, name: str) -> pa.Table:
        with self.folder.source(name) as source:
            return pq.read_table(source)

    def _write_part(
        self, tmp: Path, ids: list[Any], values: np.ndarray, meta: dict[str, list[Any]] | None, rejects: list[Any]
    ) -> None:
        """A window's part file; `meta` and `rejects` are there for a task whose part shows them
        (OpenAI answers write an error line per rejected request)."""
        if self.fmt == "parquet":
            write_parquet(results_table(ids, values, self.dim), tmp)
        else:
            rows = ({"id": i, "embedding": v} for i, v in zip(ids, values.tolist(), strict=True))
            write_jsonl_rows(tmp, rows)

    def _read_part_ids(self, name: str) -> list[Any]:
        with self.folder.source(name) as source:
            if self.fmt == "parquet":
                return pq.read_table(source, columns=[self.id_column]).column(self.id_column).to_pylist()
            with opened(source) as fh:
                return [json.loads(line)[self.id_column] for line in fh]

    # -- assembly ----------------------------------------------------------------------------------

    def assemble(self) -> None:
        """Parts -> the final output (and rejects file); then the parts go (a dataset output keeps
        them: they are its rows, and its last manifest says it is complete).

        NOTE: the output's arrival (a rename, or a multipart upload's completion) is the commit
        point; what the folder removes after it is only what a resume would no longer need.
        """
        if not self.dataset:
            self.folder.write_output(self.output, self._concat_parts)
        rejects = [w["rejects_part"] for w in self.windows if "rejects_part" in w]
        if rejects:
            self.folder.write_output(rejects_path(self.output), lambda sink: concat_bytes(sink, self.folder, rejects))
        self.folder.finish(self._manifest())

    def empty_schema(self) -> pa.Schema:
        """The output's schema; a task whose rows are not embeddings says its own."""
        return results_table([], np.zeros((0, self.dim), np.float32), self.dim).schema

    def _concat_parts(self, sink: Path | IO[bytes]) -> None:
        parts = [w["part"] for w in self.windows]
        if self.fmt != "parquet":
            concat_bytes(sink, self.folder, parts)
            return
        concat_parquet(sink, self.folder, parts, self.empty_schema())


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
