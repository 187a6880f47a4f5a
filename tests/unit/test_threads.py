"""The thread governor (device/threads.py): the team's size follows the contention the scheduler
reports, a --threads count is kept and reported, and the live /proc counters read on this machine."""

from __future__ import annotations

import os

from hpcinfer.device import threads
from hpcinfer.device.threads import PERIOD_S, Sample, ThreadGovernor, count_cpus, idle_threads, read_sample

TICK = os.sysconf("SC_CLK_TCK")


class Machine:
    """Scripted counters: each period, how many of our threads waited to run and how many of our
    cores sat idle, on average."""

    def __init__(self) -> None:
        self.now, self.waited, self.idle = 0.0, 0, 0
        self.sizes: list[int] = []

    def read(self) -> Sample:
        return Sample(self.now, 0, self.waited, self.idle)

    def period(self, waiting: float, idle: float, seconds: float = PERIOD_S) -> None:
        self.now += seconds
        self.waited += int(waiting * seconds * 1e9)
        self.idle += int(idle * seconds * TICK)

    def governor(self, most: int = 2, fixed: int | None = None, first: int | None = None) -> ThreadGovernor:
        g = ThreadGovernor(most, fixed, read=self.read, clock=lambda: self.now, set_threads=self.sizes.append)
        return g.start(first)


def test_a_quiet_machine_keeps_every_thread():
    m = Machine()
    g = m.governor()
    for _ in range(5):
        m.period(waiting=0.0, idle=0.1)
        g.tick()
    assert m.sizes == [2] and g.threads == 2 and not g.changes and g.note() is None


def test_the_first_size_is_what_the_cores_had_idle(monkeypatch):
    m = Machine()
    monkeypatch.setattr(threads, "read_sample", m.read)
    for idle, expected in ((0.05, 1), (0.9, 1), (1.8, 2), (3.9, 4), (8.0, 4)):
        count, seen = idle_threads(4, 0.5, lambda s, idle=idle: m.period(0.0, idle, s))
        assert count == expected and abs(seen - idle) < 0.05, (idle, count, seen)


def test_a_process_started_on_busy_cores_starts_its_team_small_and_may_grow():
    m = Machine()
    g = m.governor(most=2, first=1)
    assert m.sizes == [1] and g.summary()["threads_start"] == 1 and g.changes[0].threads == 1
    for _ in range(2):
        m.period(waiting=0.0, idle=1.5)
        g.tick()
    assert m.sizes == [1, 2]


def test_cpu_lists_are_counted():
    assert [count_cpus(x) for x in ("0", "0-3,8", "0,64", "")] == [1, 5, 2, 0]


def test_contention_halves_the_team_and_idle_cores_grow_it_back():
    m = Machine()
    g = m.governor(most=4)
    m.period(waiting=2.5, idle=0.0)  # our 4 threads waited 2.5 of every second: contended
    g.tick()
    assert g.threads == 2
    m.period(waiting=1.2, idle=0.0)
    g.tick()
    assert g.threads == 1
    m.period(waiting=0.4, idle=0.0)  # a lone thread still queues, and nothing is idle: stays
    g.tick()
    assert g.threads == 1
    m.period(waiting=0.0, idle=3.0)  # the other work ended: grows back after two quiet periods
    g.tick()
    assert g.threads == 1
    m.period(waiting=0.0, idle=3.0)
    g.tick()
    assert g.threads == 2
    assert m.sizes == [4, 2, 1, 2]
    assert "4 -> 2 -> 1 -> 2" in (g.note() or "") and "--threads N" in (g.note() or "")


def test_ticks_within_a_period_read_nothing():
    m = Machine()
    g = m.governor()
    m.period(waiting=5.0, idle=0.0, seconds=PERIOD_S / 4)
    g.tick()
    assert g.threads == 2


def test_a_given_thread_count_is_kept_and_the_contention_reported():
    m = Machine()
    g = m.governor(fixed=2)
    for _ in range(4):
        m.period(waiting=1.5, idle=0.0)
        g.tick()
    assert m.sizes == [2] and g.threads == 2
    assert g.summary()["contended_s"] == 4 * PERIOD_S
    assert "--threads 2 was kept" in (g.note() or "")


def test_the_live_counters_move_with_this_process():
    first = read_sample()
    if first is None:  # schedstats off or not Linux: the governor keeps its first size
        assert ThreadGovernor(2, read=lambda: None, set_threads=lambda n: None).start().threads == 2
        return
    total = sum(i * i for i in range(200_000))  # some CPU time of ours
    second = read_sample()
    assert total > 0 and second is not None and second.ran_ns > first.ran_ns and second.at > first.at


def test_one_module_sets_torch_thread_count():
    """The process's thread count has one owner: only device/threads.py calls torch.set_num_threads."""
    import ast
    from pathlib import Path

    import hpcinfer

    callers = []
    for path in Path(hpcinfer.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "set_num_threads":
                callers.append(path.relative_to(Path(hpcinfer.__file__).parent).as_posix())
    assert callers == ["device/threads.py"], callers
