"""An output's parts on an object store (S3, GCS, Azure Blob, HDFS through fsspec): commits with no rename.

- A part (or checkpoint chunk) is written to a local temporary file, then uploaded as one object:
  a store shows an object whole or not at all, so a kill mid-upload leaves nothing.
- The manifest is `_manifest-NNNNNNNN.json`, a new object for every commit, created only if that
  name is free (S3's `If-None-Match: *`, GCS's `ifGenerationMatch=0`). The highest number that
  reads is the commit point; a second writer (its lease lost) fails to create the next number and
  stops instead of overwriting the first one's commits. Older manifests are deleted after a newer
  one is written; a kill in between only leaves one more to skip.
- The lease object `_lease.json` is the lock (lease.py).
- The output assembled at the end is streamed into one object (a multipart upload, completed only
  when the last byte is in); a dataset output (a prefix: `s3://bucket/out/`) is the parts
  themselves plus the last manifest, marked complete. Names starting with `_` are what
  `pyarrow.dataset` skips, so such a prefix reads as the output's rows and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ..errors import OutputError
from . import storage
from .lease import LEASE_NAME, Lease
from .scratch import ScratchDir

_MANIFEST = re.compile(r"_manifest-(\d{8})\.json$")


def _manifest_name(seq: int) -> str:
    return f"_manifest-{seq:08d}.json"


class ObjectFolder:
    def __init__(self, uri: str, dataset: bool) -> None:
        self.uri = uri.rstrip("/")
        self.where = storage.shown(self.uri)
        self.dataset = dataset
        self.seq = 0  # the highest manifest number this run has seen or written
        self.older: set[int] = set()  # manifests seen or written that a newer one makes obsolete
        try:
            self.fs, self.key = storage.filesystem(self.uri)
        except storage.errors() as exc:
            raise OutputError(f"cannot open the output's store ({storage.failure(exc)})", path=self.where) from None

    def _key(self, name: str) -> str:
        return f"{self.key}/{name}"

    def _fail(self, what: str, exc: BaseException, name: str = "") -> OutputError:
        path = f"{self.uri}/{name}" if name else self.uri
        return OutputError(f"cannot {what} ({storage.failure(exc)})", path=storage.shown(path))

    # -- objects -----------------------------------------------------------------------------------

    def write(self, name: str, write: Any) -> None:
        """The file `write` makes, uploaded as one object (overwriting: a part's name is its window's)."""
        with ScratchDir("part") as spool:
            tmp = Path(spool) / name
            write(tmp)
            try:
                self.fs.put_file(str(tmp), self._key(name))
            except storage.errors() as exc:
                raise self._fail("write", exc, name) from None

    @contextmanager
    def source(self, name: str) -> Iterator[IO[bytes]]:
        try:
            fh = self.fs.open(self._key(name), "rb", block_size=8 << 20)
        except storage.errors() as exc:
            raise self._fail("read", exc, name) from None
        with fh:
            try:
                yield fh
            except storage.errors() as exc:  # NOTE: a read fails here, after the open
                raise self._fail("read", exc, name) from None

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._key(name))
        except FileNotFoundError:
            return None
        except storage.errors() as exc:
            raise self._fail("read", exc, name) from None

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self._key(name))
        except FileNotFoundError:
            pass
        except storage.errors() as exc:
            raise self._fail("delete", exc, name) from None

    def names(self, pattern: str) -> list[str]:
        try:
            found = self.fs.glob(self._key(pattern))
        except FileNotFoundError:
            return []
        except storage.errors() as exc:
            raise self._fail("list", exc) from None
        return sorted(p.rsplit("/", 1)[-1] for p in found)

    def _all(self) -> list[str]:
        try:
            self.fs.invalidate_cache(self.key)
            return [p[len(self.key) + 1 :] for p in self.fs.find(self.key)]  # NOTE: relative, nested ones too
        except FileNotFoundError:
            return []
        except storage.errors() as exc:
            raise self._fail("list", exc) from None

    def clear(self) -> None:
        """Everything but the lease, which this run holds. Manifest numbers keep rising from the
        highest there was: a writer that still counts on an old number finds it taken."""
        names = [n for n in self._all() if n != LEASE_NAME]
        self._saw(names)
        if names:
            try:
                self.fs.rm([self._key(n) for n in names])
            except storage.errors() as exc:
                raise self._fail("delete the earlier run's parts", exc) from None
        self.older.clear()

    def has_foreign_objects(self) -> bool:
        """Objects under the prefix, but no manifest of a run: not an output of ours."""
        names = [n for n in self._all() if n != LEASE_NAME]
        return bool(names) and not any(_MANIFEST.match(n) for n in names)

    def remove(self) -> None:
        names = self._all()
        with contextlib.suppress(*storage.errors()):
            if names:
                self.fs.rm([self._key(n) for n in names])

    # -- the manifest ------------------------------------------------------------------------------

    def _saw(self, names: list[str]) -> list[int]:
        """The manifest numbers among `names`, newest first; the next one written goes above them all."""
        numbers = sorted((int(m.group(1)) for n in names if (m := _MANIFEST.match(n))), reverse=True)
        self.seq = max([self.seq, *numbers])
        self.older.update(numbers)
        return numbers

    def read_manifest(self) -> dict[str, Any]:
        """The newest manifest that reads (a newer unreadable one is skipped, never trusted)."""
        for seq in self._saw(self._all()):
            try:
                data = json.loads(self.fs.cat_file(self._key(_manifest_name(seq))))
            except (FileNotFoundError, ValueError):
                continue
            except storage.errors() as exc:
                raise self._fail("read the manifest", exc) from None
            if isinstance(data, dict):
                return data
        return {}

    def write_manifest(self, data: dict[str, Any]) -> None:
        name, body = _manifest_name(self.seq + 1), json.dumps(data).encode()
        try:
            self.fs.pipe_file(self._key(name), body, mode="create")
        except FileExistsError:
            if self.read_bytes(name) != body:  # NOTE: else our own put, retried after its answer was lost
                raise OutputError(
                    f"another run committed to this output ({name} exists): this run stops without writing more",
                    path=self.where,
                ) from None
        except storage.errors() as exc:
            raise self._fail("write the manifest", exc, name) from None
        self.seq += 1
        self.older.add(self.seq - 1)
        for old in sorted(self.older - {self.seq, 0}):  # NOTE: only once a newer one is there
            with contextlib.suppress(*storage.errors()):  # a leftover is skipped by its number: no reason to fail
                self.fs.rm_file(self._key(_manifest_name(old)))
        self.older.clear()

    # -- lock, leftovers, the end ------------------------------------------------------------------

    def lock(self, output: str, lease_s: float) -> Lease:
        return Lease(self.fs, self._key(LEASE_NAME), output, lease_s)

    def remove_stale_temporaries(self, output: str) -> None:
        """Nothing to do: a killed upload leaves no object (a multipart upload never completed is
        the store's to expire)."""

    def write_output(self, target: str, write: Any) -> None:
        """Streams the assembled output into one object; aborted (nothing left) if writing fails."""
        try:
            fs, key = storage.filesystem(target)
            fh = fs.open(key, "wb", block_size=64 << 20)
        except storage.errors() as exc:
            raise OutputError(f"cannot write ({storage.failure(exc)})", path=storage.shown(target)) from None
        try:
            write(fh)
        except BaseException as exc:
            _discard(fh)
            if isinstance(exc, storage.errors()):
                raise OutputError(f"cannot write ({storage.failure(exc)})", path=storage.shown(target)) from None
            raise
        try:
            fh.close()
        except storage.errors() as exc:
            raise OutputError(f"cannot write ({storage.failure(exc)})", path=storage.shown(target)) from None

    def finish(self, data: dict[str, Any]) -> None:
        """A dataset: its last manifest marked complete, the rest kept; else the folder goes."""
        if self.dataset:
            self.write_manifest({**data, "complete": True})
            return
        self.remove()


def _discard(fh: Any) -> None:
    """Abandons a write: the multipart upload is aborted and the file never completes it on close."""
    with contextlib.suppress(Exception):
        if hasattr(fh, "discard"):
            fh.discard()
    fh.closed = True  # NOTE: else the file's finaliser would try to complete the upload


__all__ = ["ObjectFolder"]
