"""torch's intra-op thread count on a machine that is not ours alone: `ThreadGovernor`.

Consumes what Linux says of the scheduler (each of this process's threads' run-queue wait in
`/proc/self/task/*/schedstat`, the idle time of the cores this process may use in `/proc/stat`);
produces the thread count the compute thread runs with, changed between steps.

Why: torch's OpenMP team ends every operator at a barrier. With other work runnable on the same
cores, one descheduled team member holds the barrier for a scheduler slice (milliseconds) while
the others spin or sleep; a decode step of a small model is hundreds of operators of a few
microseconds each, so it stretches by orders of magnitude (the README's 100 SmolLM2 chats on two
cores beside two busy processes: 529 s at two threads, 98 s at one). One thread has no barrier to
hold. So while this process's threads wait on the run queue for a good share of the time, the
governor halves the team; when the cores it may use sit idle again, it grows it back. A count the
user gives (`--threads`) is kept, and the report says when steps waited on other work and names
the flag.

NOTE: OpenMP's thread count belongs to the calling thread, so `tick` is called on the thread that
computes, between its steps; nothing else in a run sets a compute thread's count while a governor
owns it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PERIOD_S = 1.0  # how often the counters are read (two small /proc reads per thread)
WAIT_SHARE = 0.25  # contended: the team's threads spent at least this share of the period on the run queue
IDLE_CORES = 0.75  # room to grow: at least this many of our cores idle, per thread added


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def count_cpus(listing: str) -> int:
    """How many CPUs a kernel CPU list names ("0-3,8" -> 5)."""
    count = 0
    for part in listing.strip().split(","):
        first, _, last = part.partition("-")
        if first:
            count += int(last or first) - int(first) + 1
    return count


def default_threads() -> int:
    """torch's own default on a quiet machine: one thread per physical core this process may use
    (hardware threads of one core share its arithmetic units)."""
    try:
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text()
        per_core = max(1, count_cpus(siblings))
    except (OSError, ValueError):
        per_core = 1
    return max(1, usable_cores() // per_core)


def set_torch_threads(threads: int) -> None:
    """The one place a run sets torch's intra-op thread count (for the calling thread's OpenMP team)."""
    import torch  # NOTE: here, so that deciding the count needs no torch (the CLI decides before importing it)

    torch.set_num_threads(threads)


def idle_threads(most: int, look_s: float = 0.3, sleep: Callable[[float], None] = time.sleep) -> tuple[int, float]:
    """(threads, idle cores): as many threads as this process's cores had idle over `look_s`
    (the caller idle meanwhile), at least one and at most `most`; (most, -1) where /proc cannot tell."""
    first = read_sample()
    if first is None or most <= 1:
        return most, -1.0
    sleep(look_s)
    now = read_sample()
    if now is None or now.at <= first.at:
        return most, -1.0
    idle = idle_cores(first, now)
    return max(1, min(most, int(idle + 1 - IDLE_CORES))), idle


@dataclass(slots=True)
class ProcessThreads:
    """What the process decided at its start: the count it may grow to, the count it began with, why."""

    most: int = 0  # 0: nothing decided (a library caller's process: torch's count is the caller's)
    start: int = 0
    why: str = ""

    def settle(self, fixed: int | None) -> int:
        """Before the model loads: --threads, else OMP_NUM_THREADS, else the idle cores (`idle_threads`)."""
        if fixed:
            self.most = self.start = fixed
            self.why = f"--threads {fixed}"
        elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
            self.most = self.start = int(os.environ["OMP_NUM_THREADS"])
            self.why = "OMP_NUM_THREADS"
        else:
            self.most = default_threads()
            self.start, idle = idle_threads(self.most)
            self.why = f"{idle:.1f} of {self.most} cores idle at the start" if idle >= 0 else "one per core"
        set_torch_threads(self.start)
        return self.start


PROCESS = ProcessThreads()  # NOTE: threads are the process's; its command line settles them once (cli/commands.py)


@dataclass(frozen=True, slots=True)
class Sample:
    """Counters at one instant: nanoseconds this process's threads ran and waited to run, and the
    idle jiffies of the cores this process may use."""

    at: float
    ran_ns: int
    waited_ns: int
    idle_jiffies: int


def read_sample(clock: Callable[[], float] = time.monotonic) -> Sample | None:
    """The counters now, or None where /proc has no schedstat (not Linux, or schedstats off)."""
    ran = waited = 0
    try:
        for task in Path("/proc/self/task").iterdir():
            try:
                fields = (task / "schedstat").read_text().split()
            except OSError:  # the thread ended between listing and reading
                continue
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        cores = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        idle = 0
        with open("/proc/stat") as stat:
            for line in stat:
                name, *values = line.split()
                if name in cores:
                    idle += int(values[3]) + int(values[4])  # idle + iowait
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return Sample(clock(), ran, waited, idle)


def idle_cores(before: Sample, now: Sample) -> float:
    """How many of our cores were idle on average between two samples."""
    return (now.idle_jiffies - before.idle_jiffies) / (os.sysconf("SC_CLK_TCK") * (now.at - before.at))


@dataclass(slots=True)
class Change:
    """One change of the thread count, for the report."""

    at_s: float  # seconds since the governor started
    threads: int
    why: str


@dataclass(slots=True)
class ThreadGovernor:
    """The compute thread's OpenMP team size, adapted to contention unless `fixed`.

    `most`: the team's largest size (the usable cores, or the replica's share of them); `fixed`:
    the user's --threads, never changed, only reported on.
    """

    most: int
    fixed: int | None = None
    read: Callable[[], Sample | None] = read_sample
    clock: Callable[[], float] = time.monotonic
    set_threads: Callable[[int], None] = set_torch_threads
    threads: int = 0
    first: int = 0  # the size the team began with
    changes: list[Change] = field(default_factory=list)
    contended_s: float = 0.0  # seconds of periods in which the team waited on the run queue
    _started: float = 0.0
    _last: Sample | None = None
    _roomy: int = 0  # consecutive periods with idle cores to grow into

    def start(self, first: int | None = None) -> ThreadGovernor:
        """Sets the team's first size on the calling (compute) thread: `first` (what the process
        began with), else `most`."""
        self.most = max(1, self.most)
        self.threads = self.first = self.fixed or max(1, min(self.most, first or self.most))
        if self.threads != self.most and not self.fixed:
            self.changes.append(Change(0.0, self.threads, "busy cores at the start"))
        self.set_threads(self.threads)
        self._started = self.clock()
        self._last = self.read()
        return self

    def tick(self) -> None:
        """Between steps, on the compute thread: reads the counters once a period and resizes."""
        if self._last is None or self.clock() - self._last.at < PERIOD_S:
            return
        now = self.read()
        if now is None:
            return
        before, self._last = self._last, now
        wall_ns = (now.at - before.at) * 1e9
        if wall_ns <= 0:
            return
        waiting = (now.waited_ns - before.waited_ns) / wall_ns  # threads of ours waiting to run, on average
        idle = idle_cores(before, now)
        contended = waiting >= WAIT_SHARE * self.threads
        if contended:
            self.contended_s += now.at - before.at
        if self.fixed is not None:
            return
        if contended and self.threads > 1:
            self._resize(max(1, self.threads // 2), f"threads waited on other work {waiting:.1f} of every second")
            self._roomy = 0
        elif not contended and self.threads < self.most and idle >= IDLE_CORES:
            self._roomy += 1
            if self._roomy >= 2:  # NOTE: two quiet periods in a row, so a gap in the other work does not flap it
                self._resize(self.threads + 1, f"{idle:.1f} of our cores idle")
                self._roomy = 0
        else:
            self._roomy = 0

    def _resize(self, threads: int, why: str) -> None:
        self.threads = threads
        self.set_threads(threads)
        self.changes.append(Change(round(self.clock() - self._started, 2), threads, why))

    def summary(self) -> dict[str, object]:
        """For the run report: the team's sizes over the run, and the time steps waited on other work."""
        return {
            "threads_start": self.first,
            "threads_most": self.most,
            "threads_end": self.threads,
            "fixed": self.fixed is not None,
            "contended_s": round(self.contended_s, 2),
            "changes": [(c.at_s, c.threads, c.why) for c in self.changes],
        }

    def note(self) -> str | None:
        """One line for the summary where other work slowed the steps, naming what to do."""
        if self.contended_s < 2 * PERIOD_S:
            return None
        if self.fixed is not None:
            return (
                f"threads: other work on these cores kept compute threads waiting for {self.contended_s:.0f} s "
                f"of the run; --threads {self.fixed} was kept (leave --threads unset to adapt, or lower it)"
            )
        sizes = " -> ".join(str(n) for n in [self.most, *(c.threads for c in self.changes)])
        return (
            f"threads: other work on these cores kept compute threads waiting for {self.contended_s:.0f} s; "
            f"threads over the run: {sizes} (--threads N fixes the count)"
        )


__all__ = [
    "PROCESS",
    "Change",
    "ProcessThreads",
    "Sample",
    "ThreadGovernor",
    "default_threads",
    "idle_threads",
    "read_sample",
    "set_torch_threads",
    "usable_cores",
]
