"""The `hpcinfer` program's end (hpcinfer/process_end.py): what the interpreter's own end does that a
program can see, the oracle being a fresh interpreter ending normally."""

from __future__ import annotations

import subprocess
import sys

import pytest

# a program that leaves, at its end, a buffered line on stdout, a non-daemon thread still working,
# an idle thread pool nobody shut down, and an atexit handler; then ends with status 3
PROGRAM = """
import atexit, concurrent.futures, io, sys, threading, time
sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False), 1 << 16))
sys.stdout.write("buffered\\n")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", file=sys.stderr, flush=True))).start()
concurrent.futures.ThreadPoolExecutor(2).submit(lambda: None).result()
atexit.register(lambda: print("atexit ran", file=sys.stderr, flush=True))
"""
ENDS = {
    "interpreter": "raise SystemExit(3)",
    "end_process": "from hpcinfer.process_end import end_process\nend_process(3)",
}


def _run(code: str, *prefix: str) -> subprocess.CompletedProcess[str]:
    # NOTE: `python -c` starts a fresh interpreter (the warm server forks only `-m` commands)
    return subprocess.run([sys.executable, *prefix, "-c", code], capture_output=True, text=True, timeout=60)


def test_the_program_ends_as_the_interpreter_would():
    done = {name: _run(PROGRAM + end) for name, end in ENDS.items()}
    for result in done.values():
        assert result.returncode == 3, result.stderr
        assert result.stdout == "buffered\n"
        assert result.stderr == "thread joined\natexit ran\n"


@pytest.mark.parametrize(("status", "returned"), [(None, 0), (0, 0), (2, 2), (256 + 1, 1), ("a message", 1)])
def test_a_commands_status_is_the_processs(status, returned):
    from hpcinfer.process_end import exit_status

    assert exit_status(status) == returned
    fresh = _run(f"raise SystemExit({status!r})")
    assert fresh.returncode == returned


def test_under_a_profiler_the_interpreter_ends_the_process_and_the_profile_is_printed(tmp_path):
    script = tmp_path / "program.py"
    script.write_text("from hpcinfer.process_end import end_process\nend_process(0)\n")
    done = subprocess.run([sys.executable, "-m", "cProfile", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "function calls" in done.stdout  # cProfile's report, printed after the program returned
