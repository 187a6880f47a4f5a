"""kill -9 at each step of the commit path, then resume: identical output, and only the rest recomputed.

Random kill moments mostly land in start-up or between commits; these land exactly on each step
(tests/integration/crash_run.py), so every state the commit path can leave behind is resumed at least once.
Also: two runs on one output (the second is refused up front, the first finishes untouched).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ..conftest import make_texts, write_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
CRASH_RUN = Path(__file__).with_name("crash_run.py")
WINDOW = 100
ROWS = 600


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model):
    """600 rows in 6 windows (two rejects among them) and the uninterrupted run's output."""
    tmp = tmp_path_factory.mktemp("crash")
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(ROWS, seed=5))]
    rows[7]["text"] = ""
    rows[350]["text"] = " "
    src = write_jsonl(tmp / "in.jsonl", rows)
    args = [str(src), "--model", str(tiny_model), "--sort-window", str(WINDOW), "--max-batch-tokens", "512"]
    args += ["--progress", "off", "-q"]
    reference = tmp / "reference.parquet"
    done = _hpcinfer(*args, "-o", str(reference))
    assert done.returncode == 0, done.stderr
    return tmp, args, reference


def _hpcinfer(*args: str, crash: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    head = [str(CRASH_RUN), crash[0], str(crash[1])] if crash else ["-m", "hpcinfer", "run"]
    return subprocess.run([sys.executable, *head, *args], capture_output=True, text=True, env=ENV, timeout=300)


def _manifest_windows(out: Path) -> list[dict]:
    try:
        return json.loads((Path(f"{out}.parts") / "manifest.json").read_text())["windows"]
    except (OSError, ValueError, KeyError):
        return []


def _same_output(out: Path, reference: Path) -> None:
    got, ref = pq.read_table(out), pq.read_table(reference)
    assert got.column("id").to_pylist() == ref.column("id").to_pylist()
    a = np.asarray(got.column("embedding").to_pylist(), dtype=np.float32)
    b = np.asarray(ref.column("embedding").to_pylist(), dtype=np.float32)
    assert np.array_equal(a, b)
    assert Path(f"{out}.rejects.jsonl").read_text() == Path(f"{reference}.rejects.jsonl").read_text()
    assert not Path(f"{out}.parts").exists()
    assert not list(out.parent.glob(f".{out.name}*.tmp-*")), "a temporary file of the killed run is left"


# point, its n-th occurrence, windows committed when it is reached
CRASH_POINTS = [
    ("parts_dir_created", 1, 0),
    ("part_written", 3, 2),  # the third part is written, not yet renamed
    ("part_renamed", 3, 2),  # the third part is in place, the manifest lists two
    ("manifest_renamed", 3, 2),  # the first manifest is the empty one of a fresh start
    ("assembling", 1, ROWS // WINDOW),
    ("output_renamed", 1, ROWS // WINDOW),
]


@pytest.mark.parametrize(("point", "nth", "committed"), CRASH_POINTS, ids=[p[0] for p in CRASH_POINTS])
def test_kill_at_each_commit_step_then_resume(job, point, nth, committed):
    tmp, args, reference = job
    out = tmp / f"{point}.parquet"
    killed = _hpcinfer(*args, "-o", str(out), crash=(point, nth))
    assert killed.returncode == -9, killed.stderr
    assert Path(f"{out}.parts", ".lock").exists(), "the killed run's lock is left behind, as after a crash"
    windows = _manifest_windows(out)
    assert len(windows) == committed
    report_path = tmp / f"{point}.report.json"
    resume = ["--resume"] if committed else []  # nothing committed: a plain rerun must work as well
    done = _hpcinfer(*args, "-o", str(out), *resume, "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    _same_output(out, reference)
    report = json.loads(report_path.read_text())
    assert report["accounting"]["rows_read"] == ROWS
    assert report["rows_resumed"] == report["accounting"]["rows_resumed"] == committed * WINDOW
    assert report["rows"] + sum(report["rejects"].values()) == ROWS - committed * WINDOW
    if committed:
        assert report["rows_resumed"] > 0


def test_resume_of_a_run_killed_before_its_first_manifest_is_a_fresh_start(job):
    tmp, args, reference = job
    out = tmp / "early.parquet"
    assert _hpcinfer(*args, "-o", str(out), crash=("parts_dir_created", 1)).returncode == -9
    done = _hpcinfer(*args, "-o", str(out), "--resume")
    assert done.returncode == 0, done.stderr
    _same_output(out, reference)


def test_a_second_run_on_the_same_output_is_refused_and_the_first_finishes(job, tiny_model):
    tmp, args, reference = job
    src = tmp / "big.jsonl"
    write_jsonl(src, [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(6000, seed=9))])
    big = [str(src), *args[1:]]
    out = tmp / "shared.parquet"
    first = subprocess.Popen(  # requests replayed at 1500/s: a run of at least 4 s, caught after its first commit
        [sys.executable, "-m", "hpcinfer", "run", *big, "-o", str(out), "--rate", "1500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lock = Path(f"{out}.parts", ".lock")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if lock.exists() and lock.read_text().strip() and _manifest_windows(out):
            break
        time.sleep(0.02)
    assert first.poll() is None, "the first run ended before the second could be started"
    # NOTE: the first run is paused, not slowed, while the others try: it holds its lock however
    # long they take on a loaded machine, and they run side by side.
    first.send_signal(signal.SIGSTOP)
    alone = tmp / "alone.parquet"
    try:
        others = [_start(*big, "-o", str(out), *extra) for extra in ([], ["--overwrite"], ["--resume"])]
        by_itself = _start(*big, "-o", str(alone))
        for second in others:
            _, stderr = second.communicate(timeout=300)
            assert second.returncode != 0
            assert f"another hpcinfer run (pid {first.pid}" in stderr, stderr
            assert "Traceback" not in stderr
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(6000)]
    _, alone_stderr = by_itself.communicate(timeout=300)
    assert by_itself.returncode == 0, alone_stderr
    a = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    b = np.asarray(pq.read_table(alone).column("embedding").to_pylist(), dtype=np.float32)
    assert np.allclose(a, b, atol=1e-5)


def _start(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hpcinfer", "run", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
