"""The server's state in SQLite (WAL): uploaded and produced files, batches, their status and counts.

One database file under the data directory, written by the HTTP handlers and the batch runner
from their threads through one connection behind a lock (SQLite serialises writers anyway; the
lock keeps a read-modify-write whole). A row is the truth: after `kill -9` the next start reads
which batches were running and resumes them. The API key is never stored: a file or batch belongs
to the SHA-256 of the key that made it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    path TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    seq INTEGER NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    priority INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    times TEXT NOT NULL DEFAULT '{}',
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, priority, seq);
"""

# The statuses a batch passes through (OpenAI's); the runner picks up the first two and `cancelling`.
WAITING = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(slots=True)
class FileRow:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    path: str


@dataclass(slots=True)
class BatchRow:
    id: str
    owner: str
    seq: int
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None
    priority: int
    status: str
    created_at: int
    expires_at: int
    times: dict[str, int] = field(default_factory=dict)  # status -> when it was entered (in_progress_at, ...)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0


class State:
    """The database under `data_dir`, created on first use."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "hpcinfer-serve.sqlite3"
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # NOTE: a status written is a status kept, even on power loss
            self._db.executescript(SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")  # NOTE: a COMMIT that failed too, so no transaction stays open
                raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- files ---------------------------------------------------------------------------------------

    def add_file(self, row: FileRow) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", _values(row))

    def file(self, file_id: str) -> FileRow | None:
        with self._lock:
            found = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRow(**dict(found)) if found is not None else None

    def files(self, owner: str, purpose: str | None = None) -> list[FileRow]:
        query, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            query, args = query + " AND purpose = ?", [*args, purpose]
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created_at DESC, id DESC", args).fetchall()
        return [FileRow(**dict(r)) for r in rows]

    def delete_file(self, file_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))

    # -- batches -------------------------------------------------------------------------------------

    def add_batch(self, row: BatchRow) -> BatchRow:
        with self._tx() as db:
            row.seq = int(db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0])
            db.execute(f"INSERT INTO batches VALUES ({', '.join('?' * 18)})", _batch_values(row))
        return row

    def batch(self, batch_id: str) -> BatchRow | None:
        with self._lock:
            found = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return _batch(found) if found is not None else None

    def batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRow], bool]:
        """The owner's batches, newest first, after the batch `after` (pagination); and whether more follow."""
        with self._lock:
            start = None
            if after is not None:
                row = self._db.execute("SELECT seq FROM batches WHERE id = ? AND owner = ?", (after, owner)).fetchone()
                start = row[0] if row is not None else None
            query, args = "SELECT * FROM batches WHERE owner = ?", [owner]
            if start is not None:
                query, args = query + " AND seq < ?", [*args, start]
            rows = self._db.execute(query + " ORDER BY seq DESC LIMIT ?", [*args, limit + 1]).fetchall()
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def next_batch(self) -> BatchRow | None:
        """The batch the runner takes next: one left running (or stopping) first, then by priority, oldest first."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM batches WHERE status IN ('in_progress', 'finalizing', 'cancelling') ORDER BY seq LIMIT 1"
            ).fetchone()
            if row is None:
                row = self._db.execute(
                    "SELECT * FROM batches WHERE status = 'validating' ORDER BY priority DESC, seq LIMIT 1"
                ).fetchone()
        return _batch(row) if row is not None else None

    def update(self, batch_id: str, *, when: str | None = None, **values: Any) -> BatchRow:
        """Sets the named columns of a batch; `when`: a status entered now (its `<status>_at` time)."""
        with self._tx() as db:
            row = _batch(db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone())
            if row.status in FINAL:
                return row  # NOTE: an ended batch stays as it ended (a finalize done twice changes nothing)
            if row.status == "cancelling" and values.get("status") in ("in_progress", "finalizing"):
                values.pop("status")  # NOTE: a cancel asked for meanwhile wins over the runner's next step
                when = None
            if when is not None:
                row.times[when] = int(time.time())
            for name, value in values.items():
                setattr(row, name, value)
            db.execute(f"REPLACE INTO batches VALUES ({', '.join('?' * 18)})", _batch_values(row))
        return row

    def request_cancel(self, batch_id: str) -> BatchRow:
        """`cancelling` unless the batch has ended (a final status stays as it is)."""
        with self._tx() as db:
            db.execute(
                "UPDATE batches SET status = 'cancelling', times = json_set(times, '$.cancelling', ?) "
                "WHERE id = ? AND status IN ('validating', 'in_progress', 'finalizing')",
                (int(time.time()), batch_id),
            )
        found = self.batch(batch_id)
        assert found is not None
        return found


def _values(row: FileRow) -> tuple[Any, ...]:
    return (row.id, row.owner, row.filename, row.purpose, row.bytes, row.created_at, row.path)


def _batch_values(row: BatchRow) -> tuple[Any, ...]:
    return (
        row.id,
        row.owner,
        row.seq,
        row.input_file_id,
        row.endpoint,
        row.completion_window,
        json.dumps(row.metadata) if row.metadata is not None else None,
        row.priority,
        row.status,
        row.created_at,
        row.expires_at,
        json.dumps(row.times),
        row.output_file_id,
        row.error_file_id,
        json.dumps(row.errors) if row.errors is not None else None,
        row.total,
        row.completed,
        row.failed,
    )


def _batch(found: sqlite3.Row) -> BatchRow:
    raw = dict(found)
    raw["metadata"] = json.loads(raw["metadata"]) if raw["metadata"] else None
    raw["times"] = json.loads(raw["times"] or "{}")
    raw["errors"] = json.loads(raw["errors"]) if raw["errors"] else None
    return BatchRow(**raw)
