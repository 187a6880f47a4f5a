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
import threading
import time
from dataclasses import replace
from pathlib import Path

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

    def live_completed(self, batch_id: str) -> int | None:
        """Requests answered so far by the running batch (None when it is not the one running)."""
        with self._lock:
            if self._running is None or self._running[0] != batch_id:
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
            except Exception as exc:  # noqa: BLE001 - a batch's failure must never stop the queue
                log.exception("batch %s failed", batch.id)
                error = {"code": "server_error", "message": f"{type(exc).__name__}: {exc}", "line": None, "param": None}
                self.state.update(batch.id, when="failed", status="failed", errors=[error])

    def _advance(self, batch: BatchRow) -> None:
        """One step of the batch's life; the loop comes back for the next."""
        if batch.status == "validating":
            self._validate(batch)
        elif batch.status == "in_progress":
            self._run(batch)
        elif batch.status == "finalizing":
            self._finalize(batch, "completed")
        elif batch.status == "cancelling":
            self._finalize(batch, "cancelled")

    def _validate(self, batch: BatchRow) -> None:
        file = self.state.file(batch.input_file_id)
        if file is None:
            error = {"code": "file_not_found", "message": "the input file was deleted", "line": None, "param": None}
            self.state.update(batch.id, when="failed", status="failed", errors=[error])
            return
        checked = check_batch_file(Path(file.path), batch.endpoint, self.max_requests)
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
            input=replace(self.base.input, paths=(file.path,)),  # NOTE: its lines say it is an OpenAI batch file
            output=replace(
                self.base.output, path=str(output), output_format="jsonl", resume=resume, overwrite=not resume
            ),
            report_path=None,
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
            elif time.time() >= batch.expires_at:
                self._finalize(now, "expired")
            return  # NOTE: the server is closing: in_progress stays, the next start resumes it
        except HpcinferError as exc:
            error = {"code": "run_failed", "message": str(exc), "line": None, "param": None}
            self.state.update(batch.id, when="failed", status="failed", errors=[error])
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
            if time.time() >= batch.expires_at:
                stop.set()
            now = self.state.batch(batch.id)
            if now is not None and now.status == "cancelling":
                stop.set()

    def _finalize(self, batch: BatchRow, status: str) -> None:
        """The job's answers split into the output file (answered) and the error file (failed lines)."""
        output = self._output(batch)
        lines = answer_lines(output)
        good = [line for line in lines if json.loads(line).get("error") is None]
        bad = [line for line in lines if json.loads(line).get("error") is not None]
        output_id = self._produce(batch, "output", good) if good or not bad else None
        error_id = self._produce(batch, "error", bad) if bad else None
        self.state.update(
            batch.id,
            when=status,
            status=status,
            output_file_id=output_id,
            error_file_id=error_id,
            completed=len(good),
            failed=len(bad),
        )

    def _produce(self, batch: BatchRow, kind: str, lines: list[bytes]) -> str:
        """A produced file, registered under an id its batch and kind decide (a finalize done twice
        after a crash writes the same file again, never a second one)."""
        file_id = "file-" + hashlib.sha256(f"{batch.id}/{kind}".encode()).hexdigest()[:24]
        path = self.data_dir / "files" / f"{file_id}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(lines))
        tmp.replace(path)
        name = f"{batch.id}_{kind}.jsonl"
        self.state.add_file(
            FileRow(file_id, batch.owner, name, "batch_output", path.stat().st_size, int(time.time()), str(path))
        )
        return file_id

    def _output(self, batch: BatchRow) -> Path:
        folder = self.data_dir / "batches" / batch.id
        folder.mkdir(parents=True, exist_ok=True)
        return folder / "output.jsonl"


def answer_lines(output: Path) -> list[bytes]:
    """The job's answer lines: its output once complete, else the parts its committed windows wrote."""
    if output.exists():
        return [line + b"\n" for line in output.read_bytes().splitlines() if line.strip()]
    folder = parts_dir(str(output))
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    lines: list[bytes] = []
    for window in sorted(manifest.get("windows", []), key=lambda w: w["window"]):
        part = folder / window["part"]
        lines += [line + b"\n" for line in part.read_bytes().splitlines() if line.strip()]
    return lines


def committed_rows(output: Path) -> int:
    """Requests a killed run had committed (a resumed batch counts them as completed from the start)."""
    try:
        manifest = json.loads((parts_dir(str(output)) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    return sum(int(w.get("rows", 0)) for w in manifest.get("windows", []))
