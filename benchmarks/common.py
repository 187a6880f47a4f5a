"""What several benchmarks share: the machine they ran on, as lscpu describes it, and a whole
process timed from its start to its exit.

A script under benchmarks/ imports it as `benchmarks.common`, with the checkout's root on sys.path
(each script puts it there: the benchmarks run from a checkout, hpcinfer installed or not).
"""

from __future__ import annotations

import shlex
import subprocess
import time


def lscpu() -> dict[str, str]:
    """lscpu's fields ("Model name", "CPU family", "Flags", "L2 cache", ...); empty where it cannot run."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = {}
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def cpu_line(threads: int) -> str:
    """The CPU a figure was measured on: its name, family and model, the threads, its SIMD flags."""
    cpu = lscpu()
    simd = " ".join(f for f in cpu.get("Flags", "").split() if f.startswith(("avx", "amx", "fma")))
    return (f"cpu: {cpu.get('Model name', '?')} (family {cpu.get('CPU family', '?')}, model {cpu.get('Model', '?')}), "
            f"{threads} threads; {simd}")  # fmt: skip


def timed_process(
    cmd: list[str], env: dict[str, str] | None = None, check: bool = True
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """(wall seconds from start to exit, the finished process), its output captured. With `check`, a
    failure ends the benchmark naming the command and the end of its stderr: a figure from a run
    that failed would compare nothing."""
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if check and done.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return wall, done
