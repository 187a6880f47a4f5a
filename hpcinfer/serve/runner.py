"""The batch queue: one batch at a time through the same job `hpcinfer run` runs, on its own thread.

A batch is checked (`validating`, validate.py), run (`in_progress`: `api.run` on its input file into
its own output under the data directory, windows committed as they finish), then split
(`finalizing`): answered lines into the output file, failed ones (OpenAI's error lines) into the
error file; `completed`. The next batch is the one left running by a killed server, else the
highest `metadata.priority`, oldest first.

A restart resumes: a batch found `in_progress` runs again with `--resume`, so the windows the
killed process committed are kept and every request is answered exactly once. Cancelling, or the
completion window passing, stops the run between work items (`api.run`'s `stop`): the committed
windows' answers become the output file, and the batch is `cancelled` or `expired`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..api import run as run_job
from ..config import RunConfig
from ..errors import HpcinferError, Interrupted
from ..files.parts import has_commits, parts_dir
from ..obs.progress import Progress
from .state import BatchRow, FileRow, State
from .validate import check_batch_file

log = logging.getLogger("hpcinfer.serve")


class BatchRunner:
    def __init__(self, state: State, data_dir: Path, base: RunConfig, max_requests: int) -> None:
        self.state, self.data_dir, self.base, self.max_requests = state, data_dir, base, max_requests
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._running: tuple[str, threading.Event, Progress, int] | None = None  # (batch, stop, progress, rows before)
        self._thread = threading.Thread(target=self._loop, name="hpcinfer-batches", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops the running batch between work items (it stays in_progress: the next start resumes it)."""
        self._closing.set()
        with self._lock:
            if self._running is not None:
                self._running[1].set()
        self._wake.set()
        self._thread.join(timeout=60)

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        with self._lock:
            if self._running is not None and self._running[0] == batch_id:
                self._running[1].set()
        self._wake.set()

    def file_path(self, file_id: str) -> Path:
        """Where a file's bytes are: derived from its id under the data directory, never a stored path."""
        return self.data_dir / "files" / f"{file_id}.jsonl"

    def cancel_waiting(self, batch_id: str) -> None:
        """A batch cancelled before it ran: finalized now (its requests into the error file), not when
        the running batch ends."""
        with self._lock:
            if self._running is not None and self._running[0] == batch_id:
                return  # NOTE: the running one stops between work items; its run finalizes it
        row = self.state.batch(batch_id)
        if row is not None and row.status == "cancelling":
            self._finalize(row, "cancelled")

    def live_completed(self, batch_id: str) -> int | None:
        """Requests answered so far by the running batch (None when it is not the one running, or has
        been finalized: the stored counts are then the true ones)."""
        with self._lock:
            if self._running is None or self._running[0] != batch_id or self._running[1].is_set():
                return None
            _, _, progress, before = self._running
            return before + progress.rows

    # -- the queue -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing.is_set():
            batch = self.state.next_batch()
            if batch is None:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                self._advance(batch)
            except Exception:  # noqa: BLE001 - a batch's failure must never stop the queue
                log.exception("batch %s failed", batch.id)  # NOTE: the details (paths) in the server's log only
                try:
                    self.state.update(batch.id, when="failed", status="failed", errors=[problem("server_error")])
                except Exception:  # noqa: BLE001 - a database that cannot be written: the next pass tries again
                    log.exception("cannot record batch %s as failed", batch.id)
                    self._wake.wait(timeout=5.0)

    def _advance(self, batch: BatchRow) -> None:
        """One step of the batch's life; the loop comes back for the next."""
        if batch.status in ("validating", "in_progress") and time.time() >= batch.expires_at:
            self._finalize(batch, "expired")  # NOTE: expired while it waited: nothing is loaded for it
        elif batch.status == "validating":
            self._validate(batch)
        elif batch.status == "in_progress":
            self._run(batch)
        elif batch.status == "finalizing":
            self._finalize(batch, "completed")
        elif batch.status == "cancelling":
            self._finalize(batch, "cancelled")

    def _validate(self, batch: BatchRow) -> None:
        file = self.state.file(batch.input_file_id)
        if file is None or not self.file_path(file.id).is_file():
            self.state.update(batch.id, when="failed", status="failed", errors=[problem("file_not_found")])
            return
        checked = check_batch_file(self.file_path(file.id), batch.endpoint, self.max_requests)
        if checked.errors:
            self.state.update(batch.id, when="failed", status="failed", errors=checked.errors)
            return
        self.state.update(batch.id, when="in_progress", status="in_progress", total=checked.requests)

    def _run(self, batch: BatchRow) -> None:
        file = self.state.file(batch.input_file_id)
        output = self._output(batch)
        if file is None or (output.exists() and not parts_dir(str(output)).exists()):
            # NOTE: killed after the job assembled its output and before the status said so
            self.state.update(batch.id, when="finalizing", status="finalizing")
            return
        resume = has_commits(str(output))
        config = replace(
            self.base,
            input=replace(self.base.input, paths=(str(self.file_path(file.id)),)),  # NOTE: its lines say it is OpenAI's
            output=replace(
                self.base.output, path=str(output), output_format="jsonl", resume=resume, overwrite=not resume
            ),
            report_path=None,
            report_html="off",
            trace_path=None,
        )
        stop, progress = threading.Event(), Progress("off")
        with self._lock:
            self._running = (batch.id, stop, progress, committed_rows(output))
        watch = threading.Thread(target=self._watch, args=(batch, stop), daemon=True)
        watch.start()
        try:
            run_job(config, progress=progress, stop=stop)
        except Interrupted:
            now = self.state.batch(batch.id)
            assert now is not None
            if now.status == "cancelling":
                self._finalize(now, "cancelled")
            elif time.time() >= now.expires_at:
                self._finalize(now, "expired")
            return  # NOTE: the server is closing: in_progress stays, the next start resumes it
        except HpcinferError as exc:
            log.error("batch %s: %s", batch.id, exc)  # NOTE: with its paths, for the server's log only
            message = str(exc).replace(str(self.data_dir), "DATA_DIR")
            if exc.path is not None:
                message = message.replace(f"{exc.path}: ", "", 1)
            self.state.update(batch.id, when="failed", status="failed", errors=[problem("run_failed", message)])
            return
        finally:
            with self._lock:
                self._running = None
            stop.set()  # NOTE: ends the watch
            watch.join()
        self.state.update(batch.id, when="finalizing", status="finalizing")
        self._finalize(self.state.batch(batch.id) or batch, "completed")

    def _watch(self, batch: BatchRow, stop: threading.Event) -> None:
        """Stops the run once its completion window has passed, or its batch is being cancelled."""
        while not stop.wait(0.25):
            now = self.state.batch(batch.id) or batch
            if now.status == "cancelling" or time.time() >= now.expires_at:
                stop.set()

    def _finalize(self, batch: BatchRow, status: str) -> None:
        """The job's answers split, a line at a time, into the output file (answered) and the error
        file (failed lines); a cancelled or expired batch's requests that never ran go to the error
        file too, as OpenAI reports them (`batch_cancelled`, `batch_expired`)."""
        output_path, error_path = self._produced(batch, "output"), self._produced(batch, "error")
        seen: set[str] = set()
        good = bad = 0
        with (
            open(output_path.with_suffix(".tmp"), "wb") as answered,
            open(error_path.with_suffix(".tmp"), "wb") as failed,
        ):
            for line in answer_lines(self._output(batch)):
                answer = json.loads(line)
                seen.add(str(answer.get("custom_id")))
                if answer.get("error") is None:
                    answered.write(line)
                    good += 1
                else:
                    failed.write(line)
                    bad += 1
            if status in ("cancelled", "expired") and (file := self.state.file(batch.input_file_id)) is not None:
                code = f"batch_{status}"
                for custom_id in unfinished(self.file_path(file.id), seen):
                    error = {"code": code, "message": f"the batch was {status} before this request ran"}
                    row = {"id": f"batch_req_{custom_id}", "custom_id": custom_id, "response": None, "error": error}
                    failed.write(json.dumps(row).encode() + b"\n")
                    bad += 1
            for fh in (answered, failed):
                fh.flush()
                os.fsync(fh.fileno())  # NOTE: on disk before a row of the state names it
        output_id = self._register(batch, "output", output_path) if good or not bad else None
        error_id = self._register(batch, "error", error_path) if bad else None
        for path, kept in ((output_path, output_id), (error_path, error_id)):
            if kept is None:
                path.with_suffix(".tmp").unlink(missing_ok=True)
        self.state.update(
            batch.id,
            when=status,
            status=status,
            output_file_id=output_id,
            error_file_id=error_id,
            completed=good,
            failed=bad,
        )

    def _produced(self, batch: BatchRow, kind: str) -> Path:
        """A produced file's path, under an id its batch and kind decide (a finalize done twice after a
        crash writes the same file again, never a second one)."""
        return self.file_path("file-" + hashlib.sha256(f"{batch.id}/{kind}".encode()).hexdigest()[:24])

    def _register(self, batch: BatchRow, kind: str, path: Path) -> str:
        path.with_suffix(".tmp").replace(path)
        file_id = path.stem
        name = f"{batch.id}_{kind}.jsonl"
        self.state.add_file(
            FileRow(file_id, batch.owner, name, "batch_output", path.stat().st_size, int(time.time()), "")
        )
        return file_id

    def _output(self, batch: BatchRow) -> Path:
        folder = self.data_dir / "batches" / batch.id
        folder.mkdir(parents=True, exist_ok=True)
        return folder / "output.jsonl"


def problem(code: str, message: str | None = None) -> dict[str, Any]:
    """An `errors.data` entry; the message says what happened without the server's paths."""
    shown = {"server_error": "the server failed on this batch; its log has the details",
             "file_not_found": "the input file was deleted"}  # fmt: skip
    return {"code": code, "message": message or shown.get(code, code), "line": None, "param": None}


def answer_lines(output: Path) -> Iterator[bytes]:
    """The job's answer lines, one at a time: its output once complete, else the parts its committed
    windows wrote."""
    if output.exists():
        files = [output]
    else:
        folder = parts_dir(str(output))
        try:
            manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        files = [folder / w["part"] for w in sorted(manifest.get("windows", []), key=lambda w: w["window"])]
    for path in files:
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    yield line if line.endswith(b"\n") else line + b"\n"


def unfinished(input_path: Path, seen: set[str]) -> Iterator[str]:
    """The input's custom ids not among `seen`, in input order (the file passed validation)."""
    with open(input_path, "rb") as fh:
        for raw in fh:
            if raw.strip():
                custom_id = str(json.loads(raw).get("custom_id"))
                if custom_id not in seen:
                    yield custom_id


def committed_rows(output: Path) -> int:
    """Requests a killed run had committed (a resumed batch counts them as completed from the start)."""
    try:
        manifest = json.loads((parts_dir(str(output)) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    return sum(int(w.get("rows", 0)) for w in manifest.get("windows", []))
