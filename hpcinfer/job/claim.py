"""The output a run claims: its lock for the whole run, and a fresh or resumed parts directory.

Every task and engine (local, several devices, Ray) claims its output the same way, so a second
run on the same output is refused, a run that fails before its first commit leaves nothing, and
`--resume` picks up exactly the committed windows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ..config import OutputConfig
from ..errors import HpcinferError
from ..files.folder import folder_for
from ..files.parts import PartStore
from .output_checks import check_output_state


class ResumableReader(Protocol):
    """What a reader must accept to resume: the rows to skip and the ids already written."""

    skip_rows: int

    def remember_ids(self, ids: Iterable[object]) -> None: ...


@contextmanager
def claimed(store: PartStore, output: OutputConfig) -> Iterator[None]:
    """Holds the output's lock (a lease on an object store) for the run; a run that fails before its
    first commit leaves no parts."""
    lock = store.folder.lock(output.path, output.lease_s).acquire()  # a second run on this output is refused here
    try:
        yield
    except BaseException:
        # NOTE: nothing worth resuming: leave no trace (but never touch a prefix that is not ours);
        # a store failing here too must not hide the error that ended the run
        with contextlib.suppress(HpcinferError, OSError):
            if store.nothing_to_keep():
                store.folder.remove()
        raise
    finally:
        lock.release()


def recorded_fingerprint(output: OutputConfig) -> dict[str, Any] | None:
    """The fingerprint of the interrupted run a `--resume` continues (None: not resuming, or nothing
    committed to resume), so a run can take over a choice that run made on its own (the int8 kernel)."""
    if not output.resume:
        return None
    manifest = folder_for(output.path).read_manifest()
    if not (manifest.get("windows") or manifest.get("partial")):
        return None
    return dict(manifest.get("fingerprint") or {})


def open_store(store: PartStore, reader: ResumableReader, output: OutputConfig) -> int:
    """Starts a fresh parts directory, or picks up a previous run's: returns the first window to do."""
    committed = store.committed()
    check_output_state(output.path, output.overwrite, output.resume, committed)
    store.remove_stale_temporaries()
    if output.resume and committed:
        store.load()
        reader.skip_rows = store.rows_committed
        reader.remember_ids(store.committed_ids())
        return len(store.windows)
    store.start_fresh()
    return 0
