"""Scratch folders carry their process id; the first one a run makes removes those a killed run left."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from hpcinfer.files import scratch


@pytest.fixture
def temp(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(scratch, "_swept", set())
    return tmp_path


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_scratch_goes_and_the_others_stay(temp):
    dead, alive = _dead_pid(), os.getpid()
    killed = temp / f"hpcinfer-part-{dead}-abc123"
    killed.mkdir()
    (killed / "part-000003.parquet").write_bytes(b"x" * 1000)
    (temp / f"hpcinfer-tp-{dead}-q1").mkdir()
    live = temp / f"hpcinfer-tune-{alive}-zz"  # a run still running: its scratch is its own
    live.mkdir()
    others = [temp / "hpcinfer-notes", temp / f"hpcinfer-part-{dead}-file", temp / f"mine-{dead}-x"]
    others[0].mkdir()
    others[1].write_text("a file, not a scratch folder")
    others[2].mkdir()

    with scratch.scratch_dir("part") as made:
        assert os.path.basename(made).startswith(f"hpcinfer-part-{alive}-")
        left = sorted(p.name for p in temp.iterdir())
    assert left == sorted([live.name, os.path.basename(made), *(p.name for p in others)])
    assert not os.path.exists(made)


def test_the_sweep_runs_once_per_temporary_folder(temp):
    dead = _dead_pid()
    made = scratch.make_scratch_dir("tp")
    assert os.path.basename(made).startswith(f"hpcinfer-tp-{os.getpid()}-")
    (temp / f"hpcinfer-part-{dead}-later").mkdir()  # left after this process's sweep: the next run's
    with scratch.scratch_dir("part"):
        assert (temp / f"hpcinfer-part-{dead}-later").is_dir()
    assert scratch.sweep(str(temp)) == [f"hpcinfer-part-{dead}-later"]
    os.rmdir(made)
