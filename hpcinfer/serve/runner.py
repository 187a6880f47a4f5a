"""The batch queue: one batch at a time through the same job `hpcinfer run` runs, on its own thread.

A batch is checked (`validating`, validate.py), run (`in_progress`: `api.run` on its input file into
its own output under the data directory, windows committed as they finish), then split
(`finalizing`): answered lines into the output file, failed ones (OpenAI's error lines) into the
error file; `completed`. The next batch is the one left running by a killed server, else the
next waiting one (state.py's `next_batch`: keys take turns, a key's priorities order its own).

One thread owns a batch at a time: the runner for the batch it works on, or the HTTP handler that
cancels a batch nobody works on. Ownership is taken under the runner's lock (`_own`); every status
change is also a compare-and-set in the state (`State.move`), so a batch is finalized exactly once
and its output written once, whatever the timing of a cancel.

A restart resumes: a batch found `in_progress` runs again with `--resume`, so the windows the
killed process committed are kept and every request is answered exactly once. Cancelling, or the
completion window passing, stops the run between work items (`api.run`'s `stop`): the committed
windows' answers become the output file, and the batch is `cancelled` or `expired`.

The model stays loaded between batches (`ModelShelf`): a queue of small batches loads it once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..api import run as run_job
from ..config import RunConfig
from ..errors import HpcinferError, Interrupted
from ..files.atomic import fsync_dir
from ..files.parts import has_commits
from ..models.shelf import ModelShelf
from ..obs.progress import Progress
from .produced import Tally, answer_lines, committed_rows, problem, request_id, unfinished
from .state import BatchRow, FileRow, State
from .validate import check_batch_file

log = logging.getLogger("hpcinfer.serve")
FINALIZE_RETRY_S = 5.0  # a finalize that failed on the disk (full) is tried again after this
SOURCES = {"completed": ("finalizing",), "cancelled": ("cancelling",), "expired": ("validating", "in_progress")}
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s/'\":,]+/)+([^\s/'\":,]+)")


class FinalizeLater(Exception):
    """The disk would not take the produced files: the batch keeps its status and is finalized later."""


class BatchRunner:
    def __init__(
        self,
        state: State,
        data_dir: Path,
        base: RunConfig,
        max_requests: int,
        shelf: ModelShelf | None = None,
        run: Callable[..., Any] = run_job,
    ) -> None:
        self.state, self.data_dir, self.base, self.max_requests = state, data_dir, base, max_requests
        self.shelf, self._run_job = shelf, run
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._owned: set[str] = set()  # batches a thread is moving now (the runner's, a cancel's)
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
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def wake(self) -> None:
        self._wake.set()

    def file_path(self, file_id: str) -> Path:
        """Where a file's bytes are: derived from its id under the data directory, never a stored path."""
        return self.data_dir / "files" / f"{file_id}.jsonl"

    def cancel(self, batch_id: str) -> BatchRow | None:
        """Asks the batch to stop (`cancelling`). One that nobody works on is finalized here and now
        (its requests into the error file); the runner's own stops between work items and the
        runner finalizes it. A batch finalizing has every answer and completes. The batch as it is."""
        row = self.state.request_cancel(batch_id)
        with self._lock:
            if self._running is not None and self._running[0] == batch_id:
                self._running[1].set()
        if row is not None and row.status == "cancelling" and self._own(batch_id):
            try:
                row = self.state.batch(batch_id)
                if row is not None and row.status == "cancelling":
                    self._finalize(row, "cancelled")
            except FinalizeLater:
                pass  # NOTE: stays cancelling; the runner finalizes it once the disk takes it
            finally:
                self._release(batch_id)
        self._wake.set()
        return self.state.batch(batch_id)

    def live_completed(self, batch_id: str) -> int | None:
        """Requests answered so far by the running batch (None when it is not the one running, or has
        been finalized: the stored counts are then the true ones)."""
        with self._lock:
            if self._running is None or self._running[0] != batch_id or self._running[1].is_set():
                return None
            _, _, progress, before = self._running
            return before + progress.rows

    def _own(self, batch_id: str) -> bool:
        with self._lock:
            if batch_id in self._owned:
                return False
            self._owned.add(batch_id)
            return True

    def _release(self, batch_id: str) -> None:
        with self._lock:
            self._owned.discard(batch_id)

    # -- the queue -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                busy = frozenset(self._owned)
            batch = self.state.next_batch(busy)
            if batch is None or not self._own(batch.id):
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                now = self.state.batch(batch.id)  # NOTE: owned now: what it is, not what it was when picked
                if now is not None:
                    self._advance(now)
            except FinalizeLater:
                self._closing.wait(timeout=FINALIZE_RETRY_S)  # NOTE: not _wake: a new batch must not hurry a retry
            except Exception:  # noqa: BLE001 - a batch's failure must never stop the queue
                log.exception("batch %s failed", batch.id)  # NOTE: the details (paths) in the server's log only
                try:
                    self._fail(batch.id, [problem("server_error")])
                except Exception:  # noqa: BLE001 - a database that cannot be written: the next pass tries again
                    log.exception("cannot record batch %s as failed", batch.id)
                    self._closing.wait(timeout=5.0)
            finally:
                self._release(batch.id)

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

    def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        sources = ("validating", "in_progress", "finalizing", "cancelling")
        if self.state.move(batch_id, sources, "failed", errors=errors) is not None:
            self._clear_job(batch_id)

    def _validate(self, batch: BatchRow) -> None:
        file = self.state.file(batch.input_file_id)
        if file is None or not self.file_path(file.id).is_file():
            self._fail(batch.id, [problem("file_not_found")])
            return
        checked = check_batch_file(self.file_path(file.id), batch.endpoint, self.max_requests)
        if checked.errors:
            self._fail(batch.id, checked.errors)
            return
        waited = f"{max(time.time() - batch.created_at, 0):.2f}"
        stats = {**batch.stats, "waited_s": waited}
        self.state.move(batch.id, ("validating",), "in_progress", total=checked.requests, stats=stats)

    def _run(self, batch: BatchRow) -> None:
        file = self.state.file(batch.input_file_id)
        output = self._output(batch)
        if output.exists():
            # NOTE: the output's arrival is the job's commit point: killed after it, nothing is run again
            self.state.move(batch.id, ("in_progress",), "finalizing")
            return
        if file is None:
            self._fail(batch.id, [problem("file_not_found")])
            return
        resume = has_commits(str(output))
        config = replace(
            self.base,
            # NOTE: its lines say it is OpenAI's; a tenant's chats bring their images inline, never as
            # paths or URIs the server could read (files/image_urls.py)
            input=replace(self.base.input, paths=(str(self.file_path(file.id)),), image_files=False),
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
        loaded_before = self.shelf.load_s if self.shelf is not None else 0.0
        try:
            self._run_job(config, progress=progress, stop=stop, shelf=self.shelf)
        except Interrupted:
            now = self.state.batch(batch.id)
            if now is not None and now.status == "cancelling":
                self._finalize(now, "cancelled")
            elif now is not None and time.time() >= now.expires_at:
                self._finalize(now, "expired")
            return  # NOTE: the server is closing: in_progress stays, the next start resumes it
        except HpcinferError as exc:
            log.error("batch %s: %s", batch.id, exc)  # NOTE: with its paths, for the server's log only
            self._fail(batch.id, [problem("run_failed", self.without_paths(str(exc), exc.path))])
            return
        finally:
            with self._lock:
                self._running = None
            stop.set()  # NOTE: ends the watch
            watch.join()
        if self.shelf is not None:
            stats = {**batch.stats, "model_load_s": f"{self.shelf.load_s - loaded_before:.3f}"}
            self.state.set(batch.id, stats=stats)
        moved = self.state.move(batch.id, ("in_progress",), "finalizing")
        if moved is not None:
            self._finalize(moved, "completed")
        elif (now := self.state.batch(batch.id)) is not None and now.status == "cancelling":
            self._finalize(now, "cancelled")  # NOTE: cancelled as it ended: every answer is there all the same

    def without_paths(self, message: str, path: str | None) -> str:
        """An error's message as a client may read it: no path of the server's in it."""
        if path is not None:
            message = message.replace(f"{path}: ", "", 1)
        message = message.replace(str(self.data_dir), "DATA_DIR")
        return ABSOLUTE_PATH.sub(lambda m: m.group(1), message)

    def _watch(self, batch: BatchRow, stop: threading.Event) -> None:
        """Stops the run once its completion window has passed, or its batch is being cancelled."""
        while not stop.wait(0.25):
            now = self.state.batch(batch.id) or batch
            if now.status == "cancelling" or time.time() >= now.expires_at:
                stop.set()

    def _finalize(self, batch: BatchRow, status: str) -> None:
        """The job's answers split, a line at a time, into the output file (answered) and the error
        file (failed lines); a cancelled or expired batch's requests that never ran go to the error
        file too, as OpenAI reports them (`batch_cancelled`, `batch_expired`). The files and the
        final status are recorded in one transaction; on a full disk nothing is (FinalizeLater)."""
        output_path, error_path = self._produced(batch, "output"), self._produced(batch, "error")
        tmps = (output_path.with_suffix(".tmp"), error_path.with_suffix(".tmp"))
        tally = Tally()
        try:
            with open(tmps[0], "wb") as answered, open(tmps[1], "wb") as failed:
                for line in answer_lines(self._output(batch)):
                    answer = json.loads(line)
                    custom_id = str(answer.get("custom_id"))
                    answer["id"] = request_id(batch.id, custom_id)  # NOTE: the job numbers rows; ids are per server
                    tally.add(custom_id, answer)
                    (answered if answer.get("error") is None else failed).write(json.dumps(answer).encode() + b"\n")
                if status in ("cancelled", "expired"):
                    code = f"batch_{status}"
                    for custom_id in unfinished(self.file_path(batch.input_file_id), tally.seen):
                        error = {"code": code, "message": f"the batch was {status} before this request ran"}
                        row = {"id": request_id(batch.id, custom_id), "custom_id": custom_id, "response": None,
                               "error": error}  # fmt: skip
                        tally.add(custom_id, row)
                        failed.write(json.dumps(row).encode() + b"\n")
                for fh in (answered, failed):
                    fh.flush()
                    os.fsync(fh.fileno())  # NOTE: on disk before a row of the state names it
            files = []
            for kind, path, tmp, kept in (("output", output_path, tmps[0], tally.good or not tally.bad),
                                          ("error", error_path, tmps[1], tally.bad)):  # fmt: skip
                if kept:
                    tmp.replace(path)
                    name = f"{batch.id}_{kind}.jsonl"
                    files.append(FileRow(path.stem, batch.owner, name, "batch_output", path.stat().st_size,
                                         int(time.time()), ""))  # fmt: skip
            fsync_dir(output_path.parent)  # NOTE: the renames durable before the state says they happened
        except OSError as exc:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise  # NOTE: not a full disk: waiting would not help; the batch fails (the loop says so)
            log.error("batch %s: cannot write its output files (%s); finalized again later", batch.id, exc)
            raise FinalizeLater from exc
        finally:
            for tmp in tmps:
                tmp.unlink(missing_ok=True)
        by_kind = {f.filename.rsplit("_", 1)[1].removesuffix(".jsonl"): f.id for f in files}
        try:
            moved = self._end(batch, status, files, by_kind, tally)
        except sqlite3.OperationalError as exc:
            if "full" not in str(exc):
                raise
            log.error("batch %s: the state's disk is full (%s); finalized again later", batch.id, exc)
            raise FinalizeLater from exc
        if moved is None:  # NOTE: cannot happen to an owned batch; were it to, nothing of it is left behind
            log.error("batch %s moved while it was finalized; its files are dropped", batch.id)
            for file in files:
                self.file_path(file.id).unlink(missing_ok=True)
            return
        self._clear_job(batch.id)

    def _end(self, batch: BatchRow, status: str, files: list[FileRow], by_kind: dict[str, str], tally: Tally) -> Any:
        return self.state.move(
            batch.id,
            SOURCES[status],
            status,
            files=tuple(files),
            output_file_id=by_kind.get("output"),
            error_file_id=by_kind.get("error"),
            total=max(batch.total, tally.good + tally.bad),
            completed=tally.good,
            failed=tally.bad,
            usage=tally.usage(),
        )

    def _clear_job(self, batch_id: str) -> None:
        """The batch's job folder, once the batch has ended: its answers are in the produced files."""
        shutil.rmtree(self.data_dir / "batches" / batch_id, ignore_errors=True)

    def _produced(self, batch: BatchRow, kind: str) -> Path:
        """A produced file's path, under an id its batch and kind decide (a finalize done twice after a
        crash writes the same file again, never a second one)."""
        return self.file_path("file-" + hashlib.sha256(f"{batch.id}/{kind}".encode()).hexdigest()[:24])

    def _output(self, batch: BatchRow) -> Path:
        folder = self.data_dir / "batches" / batch.id
        folder.mkdir(parents=True, exist_ok=True)
        return folder / "output.jsonl"
