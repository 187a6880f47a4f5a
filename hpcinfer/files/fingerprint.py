"""The resume fingerprint: what must not change between a run and its resume (inputs, model, options).

Files are known by their size and their first and last MiB (`file_digest`), cheap on any size; a
resumed run compares its fingerprint with the interrupted run's manifest and names the first
difference (`fingerprint_difference`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ..models.checkpoint import weights_file
from . import storage


def file_digest(path: str) -> str:
    """Size + the first and last MiB: cheap, and catches a changed or different file (an object on a
    store alike: two ranged reads)."""
    size = storage.size(path)
    h = hashlib.sha256(str(size).encode())
    with storage.open_binary(path, block_size=1 << 20) as fh:
        h.update(fh.read(1 << 20))
        if size > 1 << 20:
            fh.seek(max(size - (1 << 20), 1 << 20))
            h.update(fh.read())
    return h.hexdigest()[:16]


def fingerprint(files: list[str], model_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """What must not change between a run and its resume."""
    weights = weights_file(model_dir)
    return {
        "inputs": [{"path": storage.shown(f), "digest": file_digest(f)} for f in files],
        "model": {"path": str(model_dir), "weights": file_digest(str(weights)) if weights else None},
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


__all__ = ["file_digest", "fingerprint", "fingerprint_difference"]
