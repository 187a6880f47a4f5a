"""Where a run's output goes: its format, and the checks made before any work starts."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OutputError
from ..files import storage
from ..files.folder import folder_for, is_dataset, output_exists


class OutputComplete(OutputError):
    """--resume on an output that is there and complete: nothing to do, which is no failure (a
    retry loop around a run that did finish must not fail); the CLI says so and exits 0."""

    exit_code = 0


def output_format(path: str, requested: str) -> str:
    if requested != "auto":
        return requested
    if is_dataset(path):
        return "parquet"  # NOTE: a prefix has no suffix; its parts are Parquet unless --output-format says
    suffix = Path(path).suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise OutputError(
        "cannot tell the output format from the suffix; use .parquet, .jsonl or --output-format", path=path
    )


def check_output(path: str) -> None:
    """Up-front checks of where the output goes, so a long run does not fail at its very end."""
    if storage.is_remote(path):
        check_remote_output(path)
        return
    target = Path(storage.local_path(path))
    if target.is_dir():
        raise OutputError("output is a directory", path=path)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError("output directory does not exist", path=str(parent))
    if not os.access(parent, os.W_OK):
        raise OutputError("output directory is not writable", path=str(parent))


def check_remote_output(uri: str) -> None:
    """The bucket (container) is there and these credentials may look at it: a denied write shows
    at the lease, the run's first write, before any work."""
    where = storage.shown(uri)
    try:
        fs, key = storage.filesystem(uri)
        bucket = key.split("/", 1)[0]
        fs.info(bucket)
    except FileNotFoundError:
        raise OutputError(f"no such bucket '{bucket}'", path=where) from None
    except storage.errors() as exc:
        raise OutputError(f"cannot reach the output's bucket ({storage.failure(exc)})", path=where) from None


def check_resume_of_complete(path: str, resume: bool, committed: bool) -> None:
    """Before any work: --resume on a complete output (there, no commits of a later run) is done."""
    if resume and not committed and output_exists(path):
        raise OutputComplete("output exists and is complete: nothing to resume (--overwrite redoes it)", path=path)


def check_output_state(path: str, overwrite: bool, resume: bool, committed: bool) -> None:
    """What is already there: a finished output, an interrupted run's committed windows, or nothing.

    An empty or manifest-less parts directory (a run killed before its first commit) is nothing.
    """
    if overwrite:
        return
    if is_dataset(path) and folder_for(path).has_foreign_objects():  # NOTE: its start would delete them
        raise OutputError(
            "this prefix holds objects no hpcinfer run wrote: choose an empty prefix (or --overwrite to delete them)",
            path=storage.shown(path),
        )
    if output_exists(path) and not (resume and committed):
        if resume:
            raise OutputComplete("output exists and is complete: nothing to resume (--overwrite redoes it)", path=path)
        raise OutputError("output exists (use --overwrite to replace it)", path=path)
    if committed and not resume:
        raise OutputError("an interrupted run left partial results here; add --resume (or --overwrite)", path=path)
