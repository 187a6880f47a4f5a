"""Crash safety: kill -9 at random moments, resume, and get exactly the uninterrupted output."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ..conftest import make_texts, windows_committed, write_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model):
    """A job of a few seconds: 6,000 rows in 60 windows, its uninterrupted output and duration."""
    tmp = tmp_path_factory.mktemp("resume")
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(6000, seed=21))]
    rows[77]["text"] = ""  # a reject, so the rejects file is part of what must survive
    src = write_jsonl(tmp / "in.jsonl", rows)
    args = [
        str(src),
        "--model",
        str(tiny_model),
        "--sort-window",
        "100",
        "--max-batch-tokens",
        "512",
        "--progress",
        "off",
        "-q",
    ]
    reference = tmp / "reference.parquet"
    t0 = time.monotonic()
    done = _hpcinfer(*args, "-o", str(reference))
    assert done.returncode == 0, done.stderr
    return tmp, args, reference, time.monotonic() - t0


def _hpcinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpcinfer", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def _wait_for_commits(out: Path, proc: subprocess.Popen, windows: int = 2) -> None:
    """Until the run has committed a few windows (and is still running)."""
    manifest = Path(str(out) + ".parts") / "manifest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len(json.loads(manifest.read_text())["windows"]) >= windows:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError("the run did not commit windows in time")


def _interrupt(args: list[str], out: Path, sig: int) -> tuple[int, str]:
    """Starts a run, lets it commit a few windows, sends `sig`; returns (exit code, stderr)."""
    proc = _start(*args, "-o", str(out))
    _wait_for_commits(out, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr


def _same_output(out: Path, reference: Path) -> None:
    got, ref = pq.read_table(out), pq.read_table(reference)
    ids = got.column("id").to_pylist()
    assert ids == ref.column("id").to_pylist()
    assert len(set(ids)) == len(ids)
    a = np.asarray(got.column("embedding").to_pylist(), dtype=np.float32)
    b = np.asarray(ref.column("embedding").to_pylist(), dtype=np.float32)
    assert np.array_equal(a, b)
    rejects = [json.loads(x) for x in Path(str(out) + ".rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [("r77", "empty_text")]


def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(job):
    """Eight kills at random moments, each run resuming the last; a run that got to the end before
    its kill (a starved test on a busy machine) is started over, so the kills always happen."""
    tmp, args, reference, _ = job
    rng = random.Random(1234)
    out = tmp / "killed.parquet"
    kills = attempts = 0
    while kills < 8:
        attempts += 1
        assert attempts <= 40, f"{kills} kills in 40 runs: each ran to its end first"
        again = ["--overwrite"] if out.exists() else ["--resume"]  # NOTE: a run that finished starts over
        proc = _start(*args, "-o", str(out), *again)
        # A random moment: during start-up, or a random number of windows (and milliseconds) in.
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.0, 1.0))
        else:
            target = windows_committed(out) + rng.randint(1, 4)
            while proc.poll() is None and windows_committed(out) < target:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=60)
    done = _hpcinfer(*args, "-o", str(out), "--resume")
    assert done.returncode == 0, done.stderr
    _same_output(out, reference)
    assert not Path(str(out) + ".parts").exists()


def test_sigint_commits_prints_the_resume_command_and_exits_130(job):
    tmp, args, reference, _ = job
    out = tmp / "interrupted.parquet"
    code, stderr = _interrupt(args, out, signal.SIGINT)
    assert code == 130, stderr
    assert "rows are committed" in stderr
    resume_line = [line for line in stderr.splitlines() if "resume with:" in line]
    assert len(resume_line) == 1 and resume_line[0].rstrip().endswith("--resume")
    assert not out.exists()
    manifest = json.loads((Path(str(out) + ".parts") / "manifest.json").read_text())
    assert manifest["windows"], "some windows were committed before the interrupt"
    command = resume_line[0].split("resume with: ", 1)[1]
    import shlex

    argv = shlex.split(command)
    assert argv[:2] == ["hpcinfer", "run"]
    done = _hpcinfer(*argv[2:])
    assert done.returncode == 0, done.stderr
    _same_output(out, reference)


def test_sigterm_exits_143(job):
    tmp, args, _, _ = job
    code, _ = _interrupt(args, tmp / "term.parquet", signal.SIGTERM)
    assert code == 143


def test_resume_with_a_changed_option_is_refused(job):
    tmp, args, _, _ = job
    out = tmp / "changed.parquet"
    _interrupt(args, out, signal.SIGINT)
    refused = _hpcinfer(*args, "-o", str(out), "--resume", "--max-length", "64")
    assert refused.returncode != 0
    assert "cannot resume: option max_length differs (was 256, now 64)" in refused.stderr
    other_model = _hpcinfer(*[a if a != args[2] else "default" for a in args], "-o", str(out), "--resume")
    assert "cannot resume: the model differs" in other_model.stderr
    without = _hpcinfer(*args, "-o", str(out))
    assert "add --resume" in without.stderr
