"""One replica of a cluster run: hpcinfer's own engine over the windows it is handed.

A replica loads the model once, then for each unit (one window of global input rows) runs the very
pipeline of a local run, read -> tokenize -> plan -> stage -> execute -> write, with two
differences only: the reader reads just the unit's rows (`RangeReader`: same row numbers, ids,
lines and rejects as a reader of the whole input), and the writer commits into memory
(`CollectedStore`) instead of a parts directory, so the driver alone writes parts and manifest.
No Ray here: the actor in `actor.py` wraps this, and tests can run it in-process.
"""

from __future__ import annotations

import glob
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import RunConfig
from ..errors import HpcinferError, InputError, StageError
from ..files.row_values import Rows
from ..files.sources import Source
from ..obs.progress import Progress
from ..ray_engine.units import Unit
from ..types import RowBlock
from .degrade import device_fault
from .options import embed_checkpoint
from .read import Reader
from .report import RunReport


class RangeReader(Reader):
    """Reads only the rows of one unit, numbered as a reader of the whole input numbers them.

    Rows the reader lets through are remembered with their id and line (`admitted`), so that the
    driver can find ids repeated across units, which no single replica can see.
    """

    def __init__(self, cfg: Any, window_rows: int, unit: Unit) -> None:
        paths = tuple(glob.escape(p) for p in dict.fromkeys(s.path for s in unit.segments))
        super().__init__(replace(cfg, paths=paths, limit=None), window_rows)
        self.unit = unit
        self.admitted: list[tuple[int, Any, int | None, str, int]] = []  # (row, id, line, source, row in file)

    def produce(self) -> Iterator[RowBlock]:
        by_path = {s.path: s for s in self.sources}
        for seg in self.unit.segments:
            src = by_path[seg.path]
            self.rows_read = seg.file_first_row + seg.start  # NOTE: global numbering, as in a whole-input read
            for rows in self._chunks(src, seg):
                yield from self._blocks(src, rows, seg.file_first_row)
            got = self.rows_read - seg.file_first_row - seg.start
            if got != seg.rows:
                raise InputError(
                    f"read {got:,} of the {seg.rows:,} rows expected from row {seg.start:,} (did the file change?)",
                    path=src.path,
                )

    def _block(self, src: Source, rows: Rows, start: int, end: int, file_first_row: int) -> RowBlock:
        block = super()._block(src, rows, start, end, file_first_row)
        if src.has_ids:  # NOTE: without an id column ids are row numbers: never repeated
            self.admitted.extend(
                (row, row_id, line, src.path, row - file_first_row)
                for k, (row, row_id, line) in enumerate(zip(block.rows, block.ids, block.lines, strict=True))
                if k == 0 or block.rows[k - 1] != row  # a request's parts (one input row) are admitted once
            )
        return block


@dataclass(slots=True)
class Committed:
    """One window's results as the local writer would commit them: `PartStore.commit`'s arguments."""

    window_id: int
    first_row: int
    input_rows: int
    ids: list[Any]
    values: Any  # float32 [rows, dim], or a head's Ragged items
    rejects: list[dict[str, Any]]
    meta: dict[str, list[Any]] | None = None  # OpenAI answers' per-row options, rows and token counts


class CollectedStore:
    """Stands in for `PartStore` inside a replica: commits are kept in memory for the driver."""

    def __init__(self, dim: int, ragged: Any = None) -> None:
        self.dim = dim
        self.ragged = ragged  # the head's RaggedSpec, as the run's own store has it
        self.windows: list[Committed] = []

    def commit(  # noqa: ANN201
        self, window_id: int, first_row: int, input_rows: int, ids: list, values: Any, rejects: list, meta=None
    ):
        self.windows.append(Committed(window_id, first_row, input_rows, list(ids), values.copy(), rejects, meta))

    @property
    def rows_committed(self) -> int:
        return sum(w.input_rows for w in self.windows)

    @property
    def rows_written(self) -> int:
        return sum(len(w.ids) for w in self.windows)

    def assemble(self) -> None:
        """Nothing to assemble: the driver commits the windows into the real parts directory."""


@dataclass(slots=True)
class UnitResult:
    """What a replica hands back for one unit; `error` set instead when the unit failed for the user's reason."""

    window_id: int
    replica: str = ""
    windows: list[Committed] = field(default_factory=list)
    admitted: list[tuple[int, Any, int | None, str, int]] = field(default_factory=list)
    read_by_source: dict[str, int] = field(default_factory=dict)
    written_by_source: dict[str, int] = field(default_factory=dict)
    report: RunReport | None = None
    started: float = 0.0  # wall clock (time.time), to place the unit on the job's timeline
    finished: float = 0.0
    error: tuple[str, int] | None = None  # (message, exit code)
    fault: str | None = None  # set instead when its device failed: the unit is redone elsewhere


class EmbedReplica:
    """Loads the model once; `run(unit)` embeds one unit with the local engine.

    NOTE: this is the task seam: a replica turns a unit into committed windows. Generation plugs in
    a replica of its own with the same `run`.
    """

    def __init__(self, config: RunConfig) -> None:
        from ..device import resolve_dtype
        from ..models.registry import load_model
        from ..place.devices import make_run_devices
        from . import job

        self._job = job
        # NOTE: the driver resolved the plan; inside the actor the run is one local run per unit.
        self.config = replace(config, report_path=None, trace_path=None)
        self.devices = make_run_devices(self.config.device)
        self.info = embed_checkpoint(self.config)
        self.max_length = job.check_lengths(self.config, self.info)
        self.dtype = resolve_dtype(self.config.device.dtype, self.devices[0])
        if self.config.device.quantize == "int8":  # NOTE: each replica calibrates on the same first rows
            from .quantize import int8_model

            device = self.devices[0].torch_device
            self.model, _ = int8_model(self.config, self.info, device, self.dtype, self.max_length)
        else:
            self.model = load_model(self.info, self.devices[0].torch_device, self.dtype)
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def run(self, unit: Unit, progress: Progress | None = None) -> UnitResult:
        """The unit's windows; `progress` hears of each batch written (the driver's --step-timeout)."""
        result = UnitResult(unit.window_id, self.name, started=time.time())
        try:
            reader = RangeReader(self.config.input, self.config.plan.sort_window, unit)
            store = CollectedStore(self.info.output_dim, self.info.ragged)
            job = self._job.EmbedJob(
                self.config, self.devices, store, reader, self.info, self.max_length, self.dtype, unit.window_id
            )
            extras = self._job.RunExtras(progress or Progress("off"), model=self.model)
            report = _off_main_thread(lambda: self._job.execute_job(job, extras))
        except StageError as exc:  # the local run's classifier: the device's fault, or no device's
            fault = device_fault(exc, [self.devices[0].kind])
            if fault is not None:
                result.fault = fault.error
            else:
                result.error = (str(exc), exc.exit_code)
            return result
        except HpcinferError as exc:  # a user's problem: the driver reports it as one line
            result.error = (str(exc), exc.exit_code)
            return result
        result.windows = store.windows
        result.admitted = reader.admitted
        result.read_by_source = {c.path: c.read for c in reader.counts.values()}
        result.written_by_source = {f["path"]: f["written"] for f in report.accounting["files"]}
        result.report = report
        result.finished = time.time()
        return result


def _off_main_thread(fn: Any) -> Any:
    """Runs `fn` on a thread of its own: the engine installs signal handlers only on the main thread,
    and a Ray worker's main thread must keep Ray's."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread as is
            box["error"] = exc

    thread = threading.Thread(target=target, name="hpcinfer-unit")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
