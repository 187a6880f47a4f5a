"""The server's state in SQLite (WAL): uploaded and produced files, batches, their status and counts.

One database file under the data directory, written by the HTTP handlers and the batch runner
from their threads through one connection behind a lock (SQLite serialises writers anyway; the
lock keeps a read-modify-write whole). A row is the truth: after `kill -9` the next start reads
which batches were running and resumes them. The API key is never stored: a file or batch belongs
to the SHA-256 of the key that made it.

A batch's status changes only by `move`: from the statuses it names to the next one, in one
transaction, or not at all (it says which). Two threads that race for a batch (a cancel against the
runner's next step) therefore cannot both move it; an ended batch never moves again, and its
produced files are registered in the same transaction that ends it.
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
    failed INTEGER NOT NULL DEFAULT 0,
    usage TEXT,
    stats TEXT,
    started INTEGER NOT NULL DEFAULT 0
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
    usage: dict[str, Any] | None = None  # tokens, as OpenAI's Batch.usage counts them (set when it ends)
    stats: dict[str, str] = field(default_factory=dict)  # what the server measured: waited, model load
    started: int = 0  # the order in which batches began running (1, 2, ...): keys take turns by it


COLUMNS = tuple(BatchRow.__dataclass_fields__)
JSON_COLUMNS = ("metadata", "times", "errors", "usage", "stats")
ADDED_COLUMNS = {
    "usage": "TEXT",
    "stats": "TEXT",
    "started": "INTEGER NOT NULL DEFAULT 0",
}  # NOTE: a state written by an older server gains them


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
            have = {r[1] for r in self._db.execute("PRAGMA table_info(batches)")}
            for name, kind in ADDED_COLUMNS.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE batches ADD COLUMN {name} {kind}")

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

    def files(
        self, owner: str, purpose: str | None = None, after: str | None = None, limit: int = 10_000, newest: bool = True
    ) -> tuple[list[FileRow], bool]:
        """The owner's files in upload order (`newest` first, or oldest), after the file `after`
        (pagination); and whether more follow."""
        query, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            query, args = query + " AND purpose = ?", [*args, purpose]
        with self._lock:
            if after is not None:
                mark = self._db.execute("SELECT rowid FROM files WHERE id = ? AND owner = ?", (after, owner)).fetchone()
                if mark is None:
                    return [], False  # NOTE: a cursor that names no file of the key: nothing after it
                query, args = query + (" AND rowid < ?" if newest else " AND rowid > ?"), [*args, mark[0]]
            order = "DESC" if newest else "ASC"
            rows = self._db.execute(f"{query} ORDER BY rowid {order} LIMIT ?", [*args, limit + 1]).fetchall()
        return [FileRow(**dict(r)) for r in rows[:limit]], len(rows) > limit

    def bytes_of(self, owner: str) -> int:
        """What the owner's files hold on disk, in bytes (its quota counts them)."""
        with self._lock:
            return int(
                self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner = ?", (owner,)).fetchone()[0]
            )

    def file_ids(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM files")}

    def delete_file(self, file_id: str) -> bool:
        """The file's row gone, unless a batch that has not ended reads it (False): one transaction,
        so a batch created meanwhile on the file either sees it or is refused."""
        with self._tx() as db:
            final = ", ".join(f"'{s}'" for s in FINAL)
            used = db.execute(
                f"SELECT 1 FROM batches WHERE input_file_id = ? AND status NOT IN ({final}) LIMIT 1", (file_id,)
            ).fetchone()
            if used is not None:
                return False
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        return True

    # -- batches -------------------------------------------------------------------------------------

    def add_batch(self, row: BatchRow) -> BatchRow | None:
        """The batch recorded, numbered; None when its input file was deleted meanwhile."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM files WHERE id = ?", (row.input_file_id,)).fetchone() is None:
                return None
            row.seq = int(db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0])
            db.execute(f"INSERT INTO batches ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                       _batch_values(row))  # fmt: skip
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
                if row is None:
                    return [], False  # NOTE: a cursor that names no batch of the key: nothing after it
                start = row[0]
            query, args = "SELECT * FROM batches WHERE owner = ?", [owner]
            if start is not None:
                query, args = query + " AND seq < ?", [*args, start]
            rows = self._db.execute(query + " ORDER BY seq DESC LIMIT ?", [*args, limit + 1]).fetchall()
        return [_batch(r) for r in rows[:limit]], len(rows) > limit

    def next_batch(self, skip: frozenset[str] = frozenset()) -> BatchRow | None:
        """The batch the runner takes next (not one of `skip`, which another thread is moving): one left
        running or stopping first; then a waiting one, of the key whose last batch started longest ago
        (a key's priorities order its own batches, never another key's), by priority, oldest first."""
        with self._lock:
            for row in self._db.execute(
                "SELECT * FROM batches WHERE status IN ('in_progress', 'finalizing', 'cancelling') ORDER BY seq"
            ).fetchall():
                if row["id"] not in skip:
                    return _batch(row)
            waiting = self._db.execute("SELECT id, owner, priority, seq FROM batches WHERE status = 'validating'")
            waiting = [r for r in waiting.fetchall() if r["id"] not in skip]
            if not waiting:
                return None
            last_start = dict(self._db.execute("SELECT owner, MAX(started) FROM batches GROUP BY owner").fetchall())
            oldest: dict[str, int] = {}
            for r in waiting:
                oldest[r["owner"]] = min(oldest.get(r["owner"], r["seq"]), r["seq"])
            owner = min(oldest, key=lambda o: (last_start.get(o) or 0, oldest[o]))
            pick = min((r for r in waiting if r["owner"] == owner), key=lambda r: (-r["priority"], r["seq"]))
            found = self._db.execute("SELECT * FROM batches WHERE id = ?", (pick["id"],)).fetchone()
        return _batch(found)

    def move(
        self, batch_id: str, sources: tuple[str, ...], status: str, files: tuple[FileRow, ...] = (), **values: Any
    ) -> BatchRow | None:
        """The batch moved from one of `sources` to `status` (stamped `<status>_at` now), with the
        named columns set and `files` registered, all in one transaction; None when the batch is not
        in one of `sources` any more (another thread moved it first): then nothing changes."""
        with self._tx() as db:
            found = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if found is None or found["status"] not in sources:
                return None
            row = _batch(found)
            row.status = status
            row.times[status] = int(time.time())
            if status == "in_progress" and not row.started:
                row.started = int(db.execute("SELECT COALESCE(MAX(started), 0) + 1 FROM batches").fetchone()[0])
            for name, value in values.items():
                setattr(row, name, value)
            for file in files:
                db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", _values(file))
            db.execute(f"REPLACE INTO batches ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                       _batch_values(row))  # fmt: skip
        return row

    def set(self, batch_id: str, **values: Any) -> None:
        """Columns of a batch that has not ended (counts, stats); an ended batch keeps what it ended with."""
        with self._tx() as db:
            found = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if found is None or found["status"] in FINAL:
                return
            row = _batch(found)
            for name, value in values.items():
                setattr(row, name, value)
            db.execute(f"REPLACE INTO batches ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                       _batch_values(row))  # fmt: skip

    def request_cancel(self, batch_id: str) -> BatchRow | None:
        """`cancelling` from `validating` or `in_progress`; a batch finalizing has every answer and
        completes, one that has ended stays as it ended. The batch as it is now."""
        self.move(batch_id, ("validating", "in_progress"), "cancelling")
        return self.batch(batch_id)


def _values(row: FileRow) -> tuple[Any, ...]:
    return (row.id, row.owner, row.filename, row.purpose, row.bytes, row.created_at, row.path)


def _batch_values(row: BatchRow) -> tuple[Any, ...]:
    values = []
    for name in COLUMNS:
        value = getattr(row, name)
        values.append(json.dumps(value) if name in JSON_COLUMNS and value is not None else value)
    return tuple(values)


def _batch(found: sqlite3.Row) -> BatchRow:
    raw = {name: found[name] for name in COLUMNS}
    for name in JSON_COLUMNS:
        raw[name] = json.loads(raw[name]) if raw[name] else None
    raw["times"] = raw["times"] or {}
    raw["stats"] = raw["stats"] or {}
    return BatchRow(**raw)
