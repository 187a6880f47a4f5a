"""Scratch folders hold a lock while in use; a run's sweep removes those whose lock nobody holds
(what a killed run left), and nothing else."""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest

from hpcinfer.files import scratch
from tests.fixtures.killed_scratch import left_by_a_killed_run


@pytest.fixture
def temp(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(scratch, "_swept", set())
    return tmp_path


def test_a_killed_runs_scratch_goes_and_everything_else_stays(temp):
    live = scratch.ScratchDir("tune")  # in use (held) by this process
    killed = left_by_a_killed_run(temp, "part", "tp")
    assert all((temp / name / "part-000003.parquet").is_file() for name in killed)
    mine = [
        temp / "hpcinfer-part-results",  # the user's own folders and files, named alike
        temp / "hpcinfer-results-2024-05-01",
        temp / "hpcinfer-part-abcd1234-old",
        temp / "hpcinfer-tp-unlocked",
    ]
    for folder in mine:
        folder.mkdir()
    (temp / "hpcinfer-part-nolock12").mkdir()  # a scratch name without its lock file: being made
    (temp / "hpcinfer-part-afile123").write_text("a file, not a folder")
    target = temp / "elsewhere"
    target.mkdir()
    (target / scratch.HELD).write_text("")
    (temp / "hpcinfer-part-alink123").symlink_to(target)  # a link is never followed

    assert sorted(scratch.sweep(str(temp))) == sorted(killed)
    left = {p.name for p in temp.iterdir()}
    assert not left & set(killed)
    assert {os.path.basename(live.name), *(p.name for p in mine)} <= left
    assert {"hpcinfer-part-nolock12", "hpcinfer-part-afile123", "hpcinfer-part-alink123", "elsewhere"} <= left
    assert (target / scratch.HELD).exists()
    live.cleanup()
    assert not os.path.exists(live.name)


def test_a_folder_in_use_holds_its_lock_until_cleanup(temp):
    with scratch.ScratchDir("part") as made:
        assert os.path.basename(made).startswith("hpcinfer-part-")
        fd = os.open(os.path.join(made, scratch.HELD), os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # what a sweep from any process meets
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        assert scratch.sweep(str(temp)) == []
    assert not os.path.exists(made)


def test_each_temporary_folder_is_swept_once_per_process(temp, tmp_path_factory, monkeypatch):
    [first] = left_by_a_killed_run(temp, "part")
    with scratch.ScratchDir("part"):
        assert not (temp / first).exists()
    [later] = left_by_a_killed_run(temp, "part")  # after this process's sweep: the next run's to take
    scratch.sweep_once()
    assert (temp / later).is_dir()
    other = tmp_path_factory.mktemp("other-tmpdir")  # $TMPDIR moved: that folder is swept too
    [in_other] = left_by_a_killed_run(other, "profile")
    monkeypatch.setattr(tempfile, "tempdir", str(other))
    scratch.sweep_once()
    assert not (other / in_other).exists() and (temp / later).is_dir()
