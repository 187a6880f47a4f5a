"""Crash-safe output: one atomic part per window, a manifest, and the final assembly.

Layout next to the output `OUT`:
  OUT.parts/part-000042.parquet   results of window 42 (ids + embeddings, input order)
  OUT.parts/rejects-000042.jsonl  that window's rejected rows (only when there are some)
  OUT.parts/chunk-000043-000.parquet  a checkpoint: rows of window 43 finished so far (--commit-every)
  OUT.parts/manifest.json         fingerprint + the windows committed so far, in order, and the
                                  checkpoints of windows not yet committed (`partial`)
Every file is written under a temporary name, fsynced and renamed (atomic.py), and the manifest is
rewritten the same way after each part, so a kill between any two instructions leaves a consistent
prefix. At the end the parts are assembled into OUT (and OUT.rejects.jsonl), again atomically; what
a part holds and how parts join is part_format.py's, the resume fingerprint fingerprint.py's.

A checkpoint holds a task's own table of finished rows of an open window; windows themselves stay
what they are (their rows, their sorting), so a resumed run re-reads a checkpointed window and
computes only what its checkpoints lack. Committing the window drops its checkpoints.
"""

from __future__ import annotations

import contextlib
import glob
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import OutputError
from .atomic import atomic_write
from .fingerprint import fingerprint_difference
from .lock import LOCK_NAME
from .part_format import RAW_LINE, concat_bytes, concat_parquet, results_table, write_jsonl_rows

MANIFEST_VERSION = 1


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
        self.on_commit: Callable[[dict[str, Any]], None] | None = None  # told of each window committed

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
        if self.on_commit is not None:
            self.on_commit(entry)

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
            atomic_write(rejects_path(self.output), lambda tmp: concat_bytes(tmp, rejects))
        with contextlib.suppress(OSError):
            (self.dir / "manifest.json").unlink()
        shutil.rmtree(self.dir, ignore_errors=True)

    def empty_schema(self) -> pa.Schema:
        """The output's schema; a task whose rows are not embeddings says its own."""
        return results_table([], np.zeros((0, self.dim), np.float32), self.dim).schema

    def _concat_parts(self, tmp: Path) -> None:
        parts = [self.dir / w["part"] for w in self.windows]
        if self.fmt != "parquet":
            concat_bytes(tmp, parts)
            return
        concat_parquet(tmp, parts, self.empty_schema())
