"""ReadAhead: a source's items in order from a thread of its own, bounded, its errors raised where
they happened, and a close that never hangs on a producer blocked on a full queue."""

from __future__ import annotations

import threading
import time

import pytest

from hpcinfer.job.read_ahead import ReadAhead


def test_items_come_in_order_from_the_named_thread_after_its_init():
    seen: list[str] = []
    started: list[str] = []

    def source():
        for i in range(100):
            seen.append(threading.current_thread().name)
            yield i

    ahead = ReadAhead(source(), depth=4, name="tokenize", init=lambda: started.append(threading.current_thread().name))
    assert list(ahead) == list(range(100))
    assert started == ["tokenize"] and set(seen) == {"tokenize"}
    with pytest.raises(StopIteration):
        next(ahead)


def test_the_producer_runs_at_most_depth_items_ahead():
    produced = []

    def source():
        for i in range(50):
            produced.append(i)
            yield i

    ahead = ReadAhead(source(), depth=3)
    # 3 in the queue and one more waiting to be put: the producer gets there, however busy the machine
    assert _eventually(lambda: len(produced) == 4)
    time.sleep(0.2)  # NOTE: a slow machine only makes the producer slower, never faster, than this says
    assert len(produced) == 4
    assert next(ahead) == 0
    assert _eventually(lambda: len(produced) == 5)  # one taken, one more made, and no more
    ahead.close()


def _eventually(check, seconds: float = 30.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_error_in_the_source_is_raised_at_its_item():
    def source():
        yield 1
        yield 2
        raise ValueError("row 3 is bad")

    ahead = ReadAhead(source(), depth=8)
    assert next(ahead) == 1 and next(ahead) == 2
    with pytest.raises(ValueError, match="row 3 is bad"):
        next(ahead)
    with pytest.raises(StopIteration):
        next(ahead)


def test_close_stops_a_producer_blocked_on_a_full_queue():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    ahead = ReadAhead(endless(), depth=2)
    assert next(ahead) == 0
    assert _eventually(lambda: ahead._queue.full())  # NOTE: the producer is blocked on its put
    ahead.close()  # NOTE: a hang here is the failure; how long a busy machine takes is not
    assert not ahead._thread.is_alive()
