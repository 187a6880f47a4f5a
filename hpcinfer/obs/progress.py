"""Progress on stderr: a tqdm bar on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Counts rows and tokens as windows complete; thread-safe; `mode` is bar, log or off."""

    def __init__(self, mode: str = "auto", stream: TextIO | None = None, log_every_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "log"
        self.mode = mode
        self.total: int | None = None
        self.rows = 0
        self.tokens = 0
        self.device_labels: list[str] = []  # several devices: rows per device in the line
        self.device_rows: list[int] = []
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._last_log = self._start
        self._log_every = log_every_s
        self._bar = tqdm(total=None, unit="rows", file=self.stream, dynamic_ncols=True) if mode == "bar" else None

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def set_devices(self, labels: list[str]) -> None:
        self.device_labels = list(labels)
        self.device_rows = [0] * len(labels)

    def advance(self, rows: int, tokens: int, device: int = 0) -> None:
        with self._lock:
            self.rows += rows
            self.tokens += tokens
            if self.device_rows:
                self.device_rows[device] += rows
            elapsed = max(time.perf_counter() - self._start, 1e-9)
            if self._bar is not None:
                self._bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s{self._per_device()}", refresh=False)
                self._bar.update(rows)
            elif self.mode == "log" and time.perf_counter() - self._last_log >= self._log_every:
                self._last_log = time.perf_counter()
                self.stream.write(self.line(elapsed) + "\n")
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

    def line(self, elapsed: float) -> str:
        rate = self.rows / elapsed
        done = f"{self.rows:,}" + (f"/{self.total:,}" if self.total else "")
        eta = ""
        if self.total and rate > 0:
            eta = f", ETA {max(self.total - self.rows, 0) / rate:,.0f} s"
        return (
            f"hpcinfer: {done} rows, {rate:,.1f} rows/s, {self.tokens / elapsed:,.0f} tokens/s{eta}{self._per_device()}"
        )

    def _per_device(self) -> str:
        if not self.device_rows:
            return ""
        return " [" + ", ".join(f"{k} {n:,}" for k, n in zip(self.device_labels, self.device_rows, strict=True)) + "]"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
