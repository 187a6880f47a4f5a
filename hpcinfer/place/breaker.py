"""A circuit breaker per device: a device that keeps failing stops getting work, and is tried again later.

    closed --(failures within the window)--> open --(cool-down)--> half-open --(a success)--> closed
                                               ^------------------(a failure)-------------'

Closed: the device gets work; a failure is counted, and `failures` of them within `window_s`
seconds open it. Open: no new work, for `cooldown_s`. Half-open: work again, on trial: the next
success closes it, the next failure opens it again. A device that hangs (a step past its time
limit) is opened at once (`trip`). Every change is logged as a `Transition`. Pure Python and
thread-safe; the dispatcher of each task asks `available()` before sending work.

What it counts is a `DeviceFault`: what failed on which of the run's devices. One record for
every engine: the encoder pipeline's classifier (pipeline/degrade.py `device_fault`) and the
generation engines' step rule (engine/runtime/devices.py) both give one, locally and on Ray.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config import DeviceConfig
from ..errors import ConfigError

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failures: int = 2  # failures within window_s that open a breaker
    window_s: float = 600.0
    cooldown_s: float = 30.0  # open this long before a trial (half-open)


def breaker_settings(d: DeviceConfig) -> BreakerSettings:
    """`--breaker-failures/--breaker-window/--breaker-cooldown` as settings, checked with
    `--step-timeout`: a bad value is the user's error, named by its flag."""
    for flag, bad, rule in (
        ("--breaker-failures", d.breaker_failures < 1, "at least 1"),
        ("--breaker-window", d.breaker_window <= 0, "above 0 seconds"),
        ("--breaker-cooldown", d.breaker_cooldown < 0, "0 seconds or more"),
        ("--step-timeout", d.step_timeout is not None and d.step_timeout <= 0, "above 0 seconds"),
    ):
        if bad:
            raise ConfigError(f"{flag} must be {rule}")
    return BreakerSettings(d.breaker_failures, d.breaker_window, d.breaker_cooldown)


@dataclass(frozen=True, slots=True)
class Transition:
    device: str
    at_s: float  # seconds since the run's breakers were made
    state: str  # the state entered
    reason: str


class BreakerLog:
    """Every breaker's transitions of one run, in order, timed from one start."""

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, listener: Callable[[Transition], None] | None = None
    ) -> None:
        self.clock = clock
        self.start = clock()
        self.listener = listener  # told of each transition (the progress line)
        self.transitions: list[Transition] = []
        self._lock = threading.Lock()

    def add(self, device: str, state: str, reason: str) -> None:
        transition = Transition(device, round(self.clock() - self.start, 3), state, reason)
        with self._lock:
            self.transitions.append(transition)
        if self.listener is not None:
            self.listener(transition)


class Breaker:
    def __init__(self, device: str, settings: BreakerSettings, log: BreakerLog) -> None:
        if settings.failures < 1 or settings.cooldown_s < 0 or settings.window_s <= 0:
            raise ValueError("a breaker needs failures >= 1, cooldown_s >= 0 and window_s > 0")
        self.device, self.settings, self.log = device, settings, log
        self.state = CLOSED
        self.last_error = ""
        self._failures: deque[float] = deque()  # when the recent failures happened
        self._opened_at = 0.0
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether the device may get work now (an open breaker past its cool-down turns half-open)."""
        with self._lock:
            if self.state == OPEN and self.log.clock() - self._opened_at >= self.settings.cooldown_s:
                self._enter(HALF_OPEN, f"cool-down of {self.settings.cooldown_s:g} s over: on trial")
            return self.state != OPEN

    def success(self) -> None:
        with self._lock:
            if self.state == HALF_OPEN:
                self._failures.clear()
                self._enter(CLOSED, "a success on trial")

    def failure(self, error: str) -> bool:
        """Counts a device fault; True when the breaker is open after it."""
        with self._lock:
            now = self.log.clock()
            self.last_error = error
            self._failures.append(now)
            while self._failures and now - self._failures[0] > self.settings.window_s:
                self._failures.popleft()
            if self.state == HALF_OPEN or len(self._failures) >= self.settings.failures:
                self._open(now, error)
            return self.state == OPEN

    def trip(self, error: str) -> None:
        """Opens the breaker at once (a hung device)."""
        with self._lock:
            self.last_error = error
            self._open(self.log.clock(), error)

    def _open(self, now: float, reason: str) -> None:
        self._opened_at = now
        if self.state != OPEN:
            self._enter(OPEN, reason)

    def _enter(self, state: str, reason: str) -> None:
        self.state = state
        self.log.add(self.device, state, reason)


@dataclass(frozen=True, slots=True)
class DeviceFault:
    device: int  # index into the run's devices (a Ray replica's own: 0)
    error: str  # "Type: message", as the report and the final error show it
    hung: bool = False  # nothing done within --step-timeout: opened at once, not counted
    dropped: tuple[int, ...] = ()  # a generation engine's sequences it dropped: their prompts run elsewhere


def fault_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
