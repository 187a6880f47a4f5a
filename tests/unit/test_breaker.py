"""The circuit breaker as a table: states after each event, on a clock the test moves."""

from __future__ import annotations

import pytest

from hpcinfer.place.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerLog, BreakerSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(failures: int = 2, window_s: float = 10.0, cooldown_s: float = 5.0) -> tuple[Breaker, Clock]:
    clock = Clock()
    return Breaker("cuda:1", BreakerSettings(failures, window_s, cooldown_s), BreakerLog(clock)), clock


def test_failures_within_the_window_open_it_and_older_ones_are_forgotten():
    breaker, clock = make()
    assert not breaker.failure("CUDA error: an illegal memory access") and breaker.state == CLOSED
    clock.now += 11  # the first failure leaves the window
    assert not breaker.failure("again") and breaker.available()
    clock.now += 1
    assert breaker.failure("and again") and breaker.state == OPEN and not breaker.available()
    assert breaker.last_error == "and again"


def test_after_the_cooldown_a_trial_closes_it_on_success_and_reopens_it_on_failure():
    breaker, clock = make(failures=1)
    breaker.failure("lost")
    clock.now += 4.9
    assert not breaker.available()
    clock.now += 0.2
    assert breaker.available() and breaker.state == HALF_OPEN
    assert breaker.failure("lost again") and breaker.state == OPEN  # one failure on trial is enough
    clock.now += 5.1
    assert breaker.available()
    breaker.success()
    assert breaker.state == CLOSED
    log = [(t.state, t.at_s) for t in breaker.log.transitions]
    assert log == [(OPEN, 0.0), (HALF_OPEN, 5.1), (OPEN, 5.1), (HALF_OPEN, 10.2), (CLOSED, 10.2)]


def test_a_hang_opens_it_at_once_and_successes_while_closed_change_nothing():
    breaker, _ = make(failures=5)
    breaker.success()
    assert breaker.state == CLOSED and not breaker.log.transitions
    breaker.trip("a step ran past --step-timeout 600 s")
    assert breaker.state == OPEN and breaker.log.transitions[-1].reason.startswith("a step ran past")


def test_settings_that_can_never_close_are_refused():
    with pytest.raises(ValueError):
        make(failures=0)
