"""Where an output's parts live until the run ends, and how each kind of place commits.

A part store (parts.py) writes immutable parts and a manifest through a folder; the folder knows
its medium:

- `LocalFolder`, `OUT.parts/` on a local disk: every file written under a temporary name, fsynced
  and renamed; the manifest rewritten the same way; a `flock` is the lock; the output assembled
  under a temporary name and renamed.
- `ObjectFolder` (object_folder.py), on a store that has no rename and no append: a part is one
  PUT of a whole object (atomic by the store's own guarantee); each manifest is a new object whose
  number rises with every commit, created only if absent (a conditional put), so the highest
  readable one is the commit point and two writers cannot both commit; a lease object is the lock.

`folder_for(output)` picks one by the output's form.
"""

from __future__ import annotations

import contextlib
import glob
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

from ..errors import OutputError
from . import storage
from .atomic import atomic_write
from .lock import LOCK_NAME, OutputLock

Writer = Callable[[Path], None]  # writes a file at the (temporary, local) path it is given
Sink = Callable[[IO[bytes] | Path], None]  # writes the assembled output into a file or at a path


class Lock(Protocol):
    def acquire(self) -> Any: ...

    def release(self) -> None: ...


class Folder(Protocol):
    """The place of one output's parts: what a part store needs of it."""

    where: str  # for messages

    def write(self, name: str, write: Writer) -> None: ...
    def source(self, name: str) -> Any: ...  # a context manager: a path or file pyarrow and open() read
    def read_bytes(self, name: str) -> bytes | None: ...  # None: no such file
    def delete(self, name: str) -> None: ...
    def names(self, pattern: str) -> list[str]: ...
    def clear(self) -> None: ...
    def remove(self) -> None: ...
    def read_manifest(self) -> dict[str, Any]: ...
    def write_manifest(self, data: dict[str, Any]) -> None: ...
    def lock(self, output: str, lease_s: float) -> Lock: ...
    def remove_stale_temporaries(self, output: str) -> None: ...
    def write_output(self, target: str, write: Sink) -> None: ...
    def finish(self, data: dict[str, Any]) -> None: ...
    def has_foreign_objects(self) -> bool: ...


def is_dataset(output: str) -> bool:
    """An output named as a prefix (`s3://bucket/out/`): its parts and manifest are the result."""
    return storage.is_remote(output) and output.endswith("/")


def parts_location(output: str) -> str:
    return output if is_dataset(output) else output + ".parts"


def rejects_location(output: str) -> str:
    return output.rstrip("/") + ".rejects.jsonl"


def folder_for(output: str) -> Folder:
    if storage.is_remote(output):
        from .object_folder import ObjectFolder

        return ObjectFolder(parts_location(output), dataset=is_dataset(output))
    return LocalFolder(Path(parts_location(storage.local_path(output))))


class LocalFolder:
    MANIFEST = "manifest.json"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    def write(self, name: str, write: Writer) -> None:
        atomic_write(self.path / name, write)

    @contextmanager
    def source(self, name: str) -> Iterator[Path]:
        yield self.path / name

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise OutputError(f"cannot read ({exc.strerror})", path=str(self.path / name)) from None

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def names(self, pattern: str) -> list[str]:
        return sorted(p.name for p in self.path.glob(pattern))

    def clear(self) -> None:
        """Everything but the lock, which this run holds."""
        self.path.mkdir(parents=True, exist_ok=True)
        for entry in self.path.iterdir():
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def read_manifest(self) -> dict[str, Any]:
        try:
            data = json.loads((self.path / self.MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write_manifest(self, data: dict[str, Any]) -> None:
        text = json.dumps(data)
        atomic_write(self.path / self.MANIFEST, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def lock(self, output: str, lease_s: float) -> OutputLock:
        return OutputLock(self.path, output)

    def remove_stale_temporaries(self, output: str) -> None:
        """Temporary files a killed run left (a part or the output half written): this run holds the lock."""
        out = Path(storage.local_path(output))
        names = [glob.escape(out.name), glob.escape(Path(rejects_location(str(out))).name)]
        stale = [path for name in names for path in out.parent.glob(f".{name}.tmp-*")]
        if self.path.is_dir():
            stale += self.path.glob(".*.tmp-*")
        for path in stale:
            with contextlib.suppress(OSError):
                path.unlink()

    def write_output(self, target: str, write: Sink) -> None:
        atomic_write(Path(storage.local_path(target)), write)

    def has_foreign_objects(self) -> bool:
        return False  # NOTE: a local output is a file; its parts folder is ours by its name

    def finish(self, data: dict[str, Any]) -> None:
        """The output is assembled: the manifest goes first, so a kill while the folder is removed
        leaves a manifest-less one, which is nothing to resume."""
        with contextlib.suppress(OSError):
            (self.path / self.MANIFEST).unlink()
        self.remove()


def output_exists(output: str) -> bool:
    """A finished output is there (a dataset: its manifest says it is complete)."""
    if not storage.is_remote(output):
        return Path(storage.local_path(output)).exists()
    if is_dataset(output):
        return bool(folder_for(output).read_manifest().get("complete"))
    try:
        fs, key = storage.filesystem(output)
        return bool(fs.exists(key))
    except storage.errors() as exc:
        raise OutputError(f"cannot look at the output ({storage.failure(exc)})", path=storage.shown(output)) from None


__all__ = [
    "Folder",
    "LocalFolder",
    "folder_for",
    "is_dataset",
    "output_exists",
    "parts_location",
    "rejects_location",
]
