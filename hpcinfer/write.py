"""Stage 6, write: Pending -> rows on disk, in input order.

Waits on each result's d2h_done, scatters it into its window's buffer, and writes a window as soon
as all its batches are in. The output is written under a temporary name and renamed on success.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .device import OutputPool
from .errors import OutputError
from .types import Pending, Window


def output_format(path: str, requested: str) -> str:
    if requested != "auto":
        return requested
    suffix = Path(path).suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise OutputError(
        "cannot tell the output format from the suffix; use .parquet, .jsonl or --output-format", path=path
    )


def check_output(path: str, overwrite: bool) -> None:
    """Up-front checks, so a long run does not fail at its very end."""
    target = Path(path)
    if target.is_dir():
        raise OutputError("output is a directory", path=path)
    if target.exists() and not overwrite:
        raise OutputError("output exists (use --overwrite to replace it)", path=path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError("output directory does not exist", path=str(parent))
    if not os.access(parent, os.W_OK):
        raise OutputError("output directory is not writable", path=str(parent))


class ParquetSink:
    def __init__(self, path: str, dim: int) -> None:
        self.path = path
        self.dim = dim
        self._writer: pq.ParquetWriter | None = None

    def write(self, ids: list[Any], values: np.ndarray) -> None:
        flat = pa.array(values.reshape(-1), type=pa.float32())
        table = pa.table({"id": pa.array(ids), "embedding": pa.FixedSizeListArray.from_arrays(flat, self.dim)})
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema, compression="zstd")
        elif table.schema != self._writer.schema:
            table = table.cast(self._writer.schema)
        self._writer.write_table(table)

    def close(self) -> None:
        if self._writer is None:  # no rows: still a valid, empty file with the schema
            emb = pa.list_(pa.float32(), self.dim)
            pq.write_table(pa.table({"id": pa.array([], pa.string()), "embedding": pa.array([], emb)}), self.path)
        else:
            self._writer.close()


class JsonlSink:
    def __init__(self, path: str, dim: int) -> None:
        self._fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, ids: list[Any], values: np.ndarray) -> None:
        lines = (json.dumps({"id": i, "embedding": v}) for i, v in zip(ids, values.tolist(), strict=True))
        self._fh.write("\n".join(lines) + "\n")

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()


@dataclass(slots=True)
class _WindowState:
    window: Window
    values: np.ndarray  # float32 [rows, dim]
    batches_done: int = 0


class Writer:
    """Consumes Pending; a sink: produces nothing, commits windows in window order."""

    name = "write"

    def __init__(
        self,
        path: str,
        fmt: str,
        dim: int,
        outputs: OutputPool,
        on_batch: Callable[[Pending], None] | None = None,
    ) -> None:
        self.path = path
        self.dim = dim
        self.outputs = outputs
        self.on_batch = on_batch
        self.tmp_path = str(Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}"))
        self._sink = (ParquetSink if fmt == "parquet" else JsonlSink)(self.tmp_path, dim)
        self._open: dict[int, _WindowState] = {}
        self._next_window = 0
        self.rows_written = 0

    def process(self, pending: Pending) -> Iterator[None]:
        batch, out = pending.batch, pending.out
        self.wait_result(pending)
        w = batch.window
        state = self._open.get(w.window_id)
        if state is None:
            state = self._open[w.window_id] = _WindowState(w, np.empty((len(w), self.dim), np.float32))
        state.values[batch.rows] = out.host[: batch.num_rows].numpy()
        self.outputs.release(out)
        state.batches_done += 1
        if self.on_batch is not None:
            self.on_batch(pending)
        self._commit_ready()
        return iter(())

    @staticmethod
    def wait_result(pending: Pending) -> None:
        pending.out.events["d2h_done"].synchronize()

    def _commit_ready(self) -> None:
        while (state := self._open.get(self._next_window)) and state.batches_done == state.window.num_batches:
            self._sink.write(state.window.ids, state.values)
            self.rows_written += len(state.window)
            del self._open[self._next_window]
            self._next_window += 1

    def finish(self) -> Iterator[None]:
        assert not self._open, "every window must be complete at the end"
        return iter(())

    def commit(self) -> None:
        """Closes the file and moves it to its final name (atomic on one filesystem)."""
        try:
            self._sink.close()
            os.replace(self.tmp_path, self.path)
        except OSError as exc:
            self.abort()
            raise OutputError(f"cannot write output ({exc.strerror})", path=self.path) from None

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # best effort on the failure path
            self._sink.close()
        Path(self.tmp_path).unlink(missing_ok=True)
