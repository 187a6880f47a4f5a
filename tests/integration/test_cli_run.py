"""What `hpcinfer run` tells a person besides the tables: the task before the run starts, rejects
named with their file (even with -q), the progress total and ETA, bottleneck advice that fits the
run, and --model's accepted forms in --help."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcinfer.api import run
from hpcinfer.files import sources
from hpcinfer.obs.progress import Progress
from hpcinfer.obs.timing import HINTS, bottleneck

from ..conftest import small_config, write_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def hpcinfer(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcinfer", *args], cwd=cwd, capture_output=True, text=True, env=ENV, timeout=300
    )


@pytest.fixture()
def three_of_five_rejected(tmp_path: Path) -> Path:
    rows = [{"id": 1, "text": "hello"}, {"id": 2, "text": ""}, {"id": 3}, {"id": 4, "text": "world"}, {"id": 5}]
    return write_jsonl(tmp_path / "in.jsonl", rows)


def test_a_quiet_run_with_rejects_says_so_in_one_line_and_exits_0(tmp_path, tiny_model, three_of_five_rejected):
    done = hpcinfer("run", "in.jsonl", "-o", "out.parquet", "--model", str(tiny_model), "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["hpcinfer: 3 of 5 rows rejected: see out.parquet.rejects.jsonl"]
    assert len((tmp_path / "out.parquet.rejects.jsonl").read_text().splitlines()) == 3


def test_the_summary_names_the_rejects_file_and_the_task_comes_first(tmp_path, tiny_model, three_of_five_rejected):
    done = hpcinfer("run", "in.jsonl", "-o", "out.jsonl", "--model", str(tiny_model), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "task: embed (--task auto: an encoder)"
    assert lines[-1] == "3 of 5 rows rejected: see out.jsonl.rejects.jsonl"
    assert not any(line.startswith("bottleneck:") for line in lines), "a run of 2 rows names no bottleneck"


def test_a_quiet_run_without_rejects_prints_nothing(tmp_path, tiny_model):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "hello"}])
    done = hpcinfer("run", "in.jsonl", "-o", "out.parquet", "--model", str(tiny_model), "-q", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == ""


def test_the_header_goes_out_as_the_run_starts_before_any_progress_line(tmp_path, tiny_model, requests_jsonl):
    stream = io.StringIO()
    progress = Progress("log", stream=stream, log_every_s=0.0, header="task: embed (--task auto: an encoder)")
    assert stream.getvalue() == ""  # not when made: the model loads (or fails) first
    run(small_config(requests_jsonl, tmp_path / "out.parquet", tiny_model), progress=progress)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "task: embed (--task auto: an encoder)"
    assert len(lines) > 2 and all(line.startswith("hpcinfer: ") and "/300 rows" in line for line in lines[1:])


def test_the_eta_leaves_start_up_out():
    now = [0.0]
    stream = io.StringIO()
    progress = Progress("log", stream=stream, log_every_s=0.0, clock=lambda: now[0])
    now[0] = 5.0  # the model loaded in 5 s
    progress.set_total(3000)
    now[0] = 55.0  # 50 s to read, tokenize and sort the window and finish the first batch
    progress.advance(50, 100)
    assert progress.eta_s() is None  # one batch: no steady rate yet
    for k in range(1, 21):  # then 50 rows a second
        now[0] = 55.0 + k
        progress.advance(50, 100)
    assert progress.eta_s() == pytest.approx((3000 - 1050) / 50)
    assert stream.getvalue().splitlines()[-1].endswith(", ETA 39 s")
    progress.advance(1950, 100)
    assert progress.eta_s() == 0.0


def test_the_total_of_a_small_jsonl_file_is_its_row_count(tmp_path):
    long_rows = [{"id": i, "text": "word " * (40 + i % 300)} for i in range(3000)]  # 4 MiB, lengths vary
    path = write_jsonl(tmp_path / "in.jsonl", long_rows)
    path.write_bytes(path.read_bytes() + b"\n  \n")  # blank lines are not rows
    assert path.stat().st_size > 1 << 20
    assert sources.estimate_file_rows([str(path)]) == 3000


def test_a_large_jsonl_file_sorted_by_length_is_estimated_over_all_of_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "EXACT_COUNT_BYTES", 1 << 16)
    monkeypatch.setattr(sources, "SAMPLE_BYTES", 1 << 14)
    rows = [{"id": i, "text": "w" * (10 + i // 50)} for i in range(20000)]  # short rows first: 4.7 MB
    path = write_jsonl(tmp_path / "sorted.jsonl", rows)
    first = path.read_bytes()[: 1 << 14]
    from_the_start = path.stat().st_size / (len(first) / first.count(b"\n"))
    assert from_the_start > 3 * 20000  # what the first sample alone says
    assert sources.estimate_file_rows([str(path)]) == pytest.approx(20000, rel=0.05)


STAGES = [
    {"stage": name, "share": share}
    for name, share in (("read", 0.01), ("tokenize", 0.1), ("compute", 0.2), ("execute", 0.2), ("write", 0.6))
]


def test_bottleneck_advice_fits_the_run():
    assert bottleneck(STAGES, True, wall_s=30.0, output_format="jsonl") == ("write", HINTS["write"])
    stage, hint = bottleneck(STAGES, True, wall_s=30.0, output_format="parquet")
    assert stage == "write" and "instead of JSONL" not in hint and "Parquet already" in hint
    assert bottleneck(STAGES, True, wall_s=0.4, output_format="parquet")[0] == ""
    assert bottleneck(STAGES, True)[0] == "write"  # without the wall time: as before


def test_help_names_every_form_of_model():
    done = hpcinfer("run", "--help", cwd=Path.cwd())
    text = " ".join(done.stdout.split())
    for form in ("default", "all-MiniLM-L6-v2", "smollm2", ".gguf", "folder"):
        assert form in text, form


def test_report_json_keeps_its_bottleneck_empty_for_a_tiny_run(tmp_path, tiny_model, three_of_five_rejected):
    report = tmp_path / "report.json"
    done = hpcinfer("run", "in.jsonl", "-o", "out.parquet", "--model", str(tiny_model), "-q", "--report",
                    str(report), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    assert data["bottleneck"] == "" and "too short" in data["hint"]
    assert data["padding_efficiency"] > 0
