"""User errors: one clear line naming the file and the problem, non-zero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import write_jsonl


def hpcinfer(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcinfer", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.fixture()
def good(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "good.jsonl", [{"id": 1, "text": "hello"}, {"id": 2, "text": "world"}])


def _cases(tmp_path: Path, good: Path, tiny_model: Path) -> dict[str, tuple[list[str], str, str]]:
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    (tmp_path / "exists.parquet").write_bytes(b"x")
    model = ["--model", str(tiny_model)]
    return {
        "missing file": (["run", "nope.jsonl", "-o", "o.parquet", *model], "nope.jsonl", "no such file"),
        "unknown column": (
            ["run", str(good), "-o", "o.parquet", "--text-column", "body", *model],
            "good.jsonl",
            "no column 'body'",
        ),
        "unreadable parquet": (
            ["run", "bad.parquet", "-o", "o.parquet", *model],
            "bad.parquet",
            "not a readable Parquet",
        ),
        "existing output": (["run", str(good), "-o", "exists.parquet", *model], "exists.parquet", "output exists"),
        "unknown model": (
            ["run", str(good), "-o", "o.parquet", "--model", "no/such/model"],
            "no/such/model",
            "not found",
        ),
    }


@pytest.mark.parametrize(
    "case", ["missing file", "unknown column", "unreadable parquet", "existing output", "unknown model"]
)
def test_user_error_is_one_clear_line(case, tmp_path, good, tiny_model):
    args, names, problem = _cases(tmp_path, good, tiny_model)[case]
    proc = hpcinfer(*args, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert names in lines[0] and problem in lines[0], lines[0]
    assert not (tmp_path / "o.parquet").exists()
    assert (tmp_path / "exists.parquet").read_bytes() == b"x"


def test_overwrite_replaces_and_help_lists_every_option(tmp_path, good, tiny_model):
    out = tmp_path / "o.parquet"
    out.write_bytes(b"old")
    proc = hpcinfer("run", str(good), "-o", str(out), "--model", str(tiny_model), "--overwrite", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:4] == b"PAR1"
    assert not list(tmp_path.glob(".o.parquet.tmp*"))
    helptext = hpcinfer("run", "--help", cwd=tmp_path).stdout
    for option in ("--max-batch-tokens", "--sort-window", "--staging-buffers", "--streams", "--no-overlap", "--trace"):
        assert option in helptext
