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

    def advance(self, rows: int, tokens: int) -> None:
        with self._lock:
            self.rows += rows
            self.tokens += tokens
            elapsed = max(time.perf_counter() - self._start, 1e-9)
            if self._bar is not None:
                self._bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
                self._bar.update(rows)
            elif self.mode == "log" and time.perf_counter() - self._last_log >= self._log_every:
                self._last_log = time.perf_counter()
                self.stream.write(self.line(elapsed) + "\n")
                self.stream.flush()

    def line(self, elapsed: float) -> str:
        rate = self.rows / elapsed
        done = f"{self.rows:,}" + (f"/{self.total:,}" if self.total else "")
        eta = ""
        if self.total and rate > 0:
            eta = f", ETA {max(self.total - self.rows, 0) / rate:,.0f} s"
        return f"hpcinfer: {done} rows, {rate:,.1f} rows/s, {self.tokens / elapsed:,.0f} tokens/s{eta}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
