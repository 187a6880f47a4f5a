"""How a local output is assembled from its parts: one part becomes the output by a second name
(no copy at the run's end), several are joined, and where no link can be made the bytes are copied."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from hpcinfer.files import part_format
from hpcinfer.files.folder import LocalFolder
from hpcinfer.files.part_format import concat_bytes


def _folder_with(tmp_path: Path, parts: dict[str, bytes]) -> LocalFolder:
    folder = LocalFolder(tmp_path / "out.jsonl.parts")
    folder.path.mkdir()
    for name, data in parts.items():
        folder.write(name, lambda tmp, data=data: tmp.write_bytes(data))
    return folder


def _assemble(folder: LocalFolder, out: Path, parts: list[str]) -> None:
    folder.write_output(str(out), lambda sink: concat_bytes(sink, folder, parts))


def test_one_local_part_is_linked_as_the_output_and_outlives_the_parts_folder(tmp_path):
    folder = _folder_with(tmp_path, {"part-000000.jsonl": b'{"id": 1}\n{"id": 2}\n'})
    part = folder.path / "part-000000.jsonl"
    out = tmp_path / "out.jsonl"
    _assemble(folder, out, [part.name])
    assert out.stat().st_ino == part.stat().st_ino  # the part's file, not a copy of it
    folder.remove()
    assert out.read_bytes() == b'{"id": 1}\n{"id": 2}\n'
    assert not list(tmp_path.glob(".out.jsonl.tmp-*"))


def test_several_parts_are_joined_in_order(tmp_path):
    folder = _folder_with(tmp_path, {"part-000000.jsonl": b'{"id": 1}\n', "part-000001.jsonl": b'{"id": 2}\n'})
    out = tmp_path / "out.jsonl"
    _assemble(folder, out, ["part-000000.jsonl", "part-000001.jsonl"])
    assert out.read_bytes() == b'{"id": 1}\n{"id": 2}\n'
    assert out.stat().st_ino != (folder.path / "part-000000.jsonl").stat().st_ino


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.EPERM, errno.EEXIST])
def test_where_no_link_can_be_made_the_part_is_copied(tmp_path, monkeypatch, refusal):
    def no_link(src, dst):
        raise OSError(refusal, "no link")

    monkeypatch.setattr(part_format.os, "link", no_link)
    folder = _folder_with(tmp_path, {"part-000000.jsonl": b'{"id": 1}\n'})
    out = tmp_path / "out.jsonl"
    _assemble(folder, out, ["part-000000.jsonl"])
    assert out.stat().st_ino != (folder.path / "part-000000.jsonl").stat().st_ino
    folder.remove()
    assert out.read_bytes() == b'{"id": 1}\n'
