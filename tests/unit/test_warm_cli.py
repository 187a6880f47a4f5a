"""The warm server's children end as fresh interpreters end (tests/fixtures/warm_cli.py): a fresh
`python -m` of the same program is the oracle, for each way a program can end."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.fixtures.warm_cli import WarmPopen

PROBE = [sys.executable, "-m", "tests.fixtures.exit_probe"]


def _run(how: str, folder, warm: bool) -> subprocess.CompletedProcess[str]:
    # NOTE: an explicit `executable` is one of the options the server cannot honour: a fresh interpreter
    extra = {} if warm else {"executable": sys.executable}
    return subprocess.run([*PROBE, how, str(folder)], capture_output=True, text=True, timeout=60, **extra)


@pytest.mark.parametrize(
    ("how", "returncode", "stderr_has"),
    [
        ("none", 0, ""),
        ("buffered", 0, ""),
        ("code", 3, ""),
        ("message", 1, "stopped: a message for stderr"),
        ("raise", 1, "ValueError: an uncaught error"),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
        ("thread", 0, ""),
        ("atexit", 0, "atexit ran"),
    ],
)
def test_a_warm_child_ends_as_a_fresh_interpreter_does(how, returncode, stderr_has, tmp_path):
    fresh, warm = tmp_path / "fresh", tmp_path / "warm"
    fresh.mkdir(), warm.mkdir()
    cold = _run(how, fresh, warm=False)
    forked = _run(how, warm, warm=True)
    assert cold.stdout == "warm=False\n"
    # the server's child had torch already (where the server runs: not under HPCINFER_TEST_COLD)
    assert forked.stdout == f"warm={subprocess.Popen is WarmPopen}\n"
    for done in (cold, forked):
        assert done.returncode == returncode, done.stderr
        assert stderr_has in done.stderr
    assert (cold.stderr == "") == (forked.stderr == "")
    if how == "thread":  # a non-daemon thread is joined before the process ends
        assert (fresh / "thread.txt").read_text() == (warm / "thread.txt").read_text() == "joined"
