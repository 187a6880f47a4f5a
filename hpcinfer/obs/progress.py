"""Progress on stderr: a tqdm bar on a terminal, plain periodic log lines otherwise.

The run's clock starts when the job starts (`set_total`), not when the Progress is made (the model
may load in between). The ETA divides the rows left by the rate since the first rows finished:
start-up and the pipeline filling up (the first batch waits for the window to be read, tokenized
and sorted) are not part of the rate at which rows keep finishing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from .meter import Meter

BREAKER_STATES = {"closed": 0, "half-open": 1, "open": 2}  # the metrics endpoint's gauge values
ETA_AFTER_S = 1.0  # the steady rate needs this long since the first rows finished before an ETA is given


class Progress:
    """Counts rows and tokens as windows complete; thread-safe; `mode` is bar, log or off.

    `header` is a line written once when the run starts (`set_total`), in every mode, before any
    progress line: the CLI's `task: ...`.
    """

    def __init__(
        self,
        mode: str = "auto",
        stream: TextIO | None = None,
        log_every_s: float = 10.0,
        *,
        header: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        meter: Meter | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.meter = meter or Meter()  # the same counts, for the report's charts and the metrics endpoint
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode = mode
        self.header = header
        self.clock = clock
        self.total: int | None = None
        self.rows = 0
        self.tokens = 0
        self.device_labels: list[str] = []  # several devices: rows per device in the line
        self.device_rows: list[int] = []
        self._lock = threading.Lock()
        self._start = clock()
        self._last_log = self._start
        self._log_every = log_every_s
        self._first: tuple[float, int] | None = None  # (when, rows) the first rows finished
        self._bar: tqdm | None = None

    def set_total(self, total: int) -> None:
        """The rows this run has to do; the first call starts the run's clock (and shows the header)."""
        with self._lock:
            if self.header is not None:
                self.stream.write(self.header + "\n")
                self.stream.flush()
                self.header = None
            if self._bar is None and self.rows == 0:
                self._start = self._last_log = self.clock()
                self.meter.job_started()
            self.total = total
            bar = self._make_bar()
            if bar is not None:
                bar.total = total
                bar.refresh()

    def _make_bar(self) -> tqdm | None:
        if self.mode == "bar" and self._bar is None:
            self._bar = tqdm(total=self.total, unit="rows", file=self.stream, dynamic_ncols=True)
        return self._bar

    def set_devices(self, labels: list[str]) -> None:
        self.device_labels = list(labels)
        self.device_rows = [0] * len(labels)
        if len(labels) > 1:
            for label in labels:
                self.meter.add(f"device_rows.{label}", 0)
                self.meter.add(f"device_tokens.{label}", 0)
                if f"breaker_state.{label}" not in self.meter.kinds:  # NOTE: a restart keeps an open breaker open
                    self.meter.set(f"breaker_state.{label}", BREAKER_STATES["closed"])

    def breaker(self, device: str, state: str, line: str) -> None:
        """A device's breaker changed state: a line of its own, a mark on the report's timeline."""
        self.meter.event("breaker", device=device, state=state)
        self.meter.set(f"breaker_state.{device}", BREAKER_STATES.get(state, -1))
        self.note(line)

    def advance(self, rows: int, tokens: int, device: int = 0) -> None:
        with self._lock:
            now = self.clock()
            self.rows += rows
            self.tokens += tokens
            if self._first is None:
                self._first = (now, self.rows)
            self.meter.add("rows_finished", rows)  # NOTE: as batches finish; rows.done moves at commits
            if self.device_rows:
                self.device_rows[device] += rows
                if len(self.device_rows) > 1:
                    label = self.device_labels[device]
                    self.meter.add(f"device_rows.{label}", rows)
                    self.meter.add(f"device_tokens.{label}", tokens)
            elapsed = max(now - self._start, 1e-9)
            bar = self._make_bar()
            if bar is not None:
                bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s{self._per_device()}", refresh=False)
                bar.update(rows)
            elif self.mode == "log" and now - self._last_log >= self._log_every:
                self._last_log = now
                self.stream.write(self.line(elapsed, now) + "\n")
                self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (an event such as a device taken out of the run), in every mode but off."""
        if self.mode == "off":
            return
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds left at the rate rows have finished since the first did; None until that rate is known."""
        if not self.total or self._first is None:
            return None
        if self.rows >= self.total:
            return 0.0
        now = self.clock() if now is None else now
        since, rows_then = self._first
        if now - since < ETA_AFTER_S or self.rows <= rows_then:
            return None
        rate = (self.rows - rows_then) / (now - since)
        return max(self.total - self.rows, 0) / rate

    def line(self, elapsed: float, now: float | None = None) -> str:
        rate = self.rows / elapsed
        done = f"{self.rows:,}" + (f"/{self.total:,}" if self.total else "")
        return (
            f"hpcinfer: {done} rows, {rate:,.1f} rows/s, {self.tokens / elapsed:,.0f} tokens/s"
            f"{self._eta_note(now)}{self._per_device()}"
        )

    def _eta_note(self, now: float | None) -> str:
        eta = self.eta_s(now)
        return f", ETA {eta:,.0f} s" if eta is not None else ""

    def _per_device(self) -> str:
        if len(self.device_rows) < 2:
            return ""
        return " [" + ", ".join(f"{k} {n:,}" for k, n in zip(self.device_labels, self.device_rows, strict=True)) + "]"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
