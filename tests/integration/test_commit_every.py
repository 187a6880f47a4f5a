"""--commit-every: rows finished inside a window are checkpointed on the clock, a kill loses at most
that much, and --resume takes them back to write exactly the uninterrupted output (embedding and
generation); --resume on a complete output is no failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcinfer.cli.options import build_run_config
from hpcinfer.config import PlanConfig
from hpcinfer.errors import ConfigError
from hpcinfer.files.parts import PartStore
from hpcinfer.job.rejects import RejectCounter
from hpcinfer.pipeline.held import Held, load_held
from hpcinfer.pipeline.plan import Planner, TokenBudget, cut_batches
from hpcinfer.pipeline.types import Batch, Pending, TokenBlock, Window
from hpcinfer.pipeline.write import Writer
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, write_jsonl
from ..unit.test_cli_options import parsed

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
DIM = 4
T0 = 1000.0  # the fake clock's origin, seconds


# -- the writer's checkpoints, on a fake clock ----------------------------------------------------


class _Event:
    def synchronize(self) -> None:
        pass


class _Out:
    def __init__(self, values: np.ndarray) -> None:
        self.host = torch.from_numpy(values)
        self.events = {"d2h_done": _Event()}


class _Pool:
    def release(self, out: _Out) -> None:
        pass


def _window(rows: int = 6, batches: int = 3) -> Window:
    return Window(
        window_id=0,
        first_row=0,
        input_rows=rows,
        ids=[f"r{i}" for i in range(rows)],
        flat_ids=np.zeros(rows, np.int32),
        offsets=np.arange(rows + 1, dtype=np.int64),
        block_ids=np.zeros(rows, np.int64),
        rows=np.arange(rows, dtype=np.int64),
        sources={0: "in.jsonl"},
        num_batches=batches,
        cut_tokens=64,
    )


def _landed(window: Window, batch_id: int, rows: list[int], started_s: float, values: np.ndarray) -> Pending:
    index = np.asarray(rows, dtype=np.int64)
    # NOTE: times count from T0 (a started_ns of 0 means "not staged", as a window of rejects only)
    batch = Batch(batch_id, window, index, np.ones(len(rows), np.int32), 1, 0, int((T0 + started_s) * 1e9))
    return Pending(batch, _Out(values[index]))


def _manifest(out: Path) -> dict:
    return json.loads((Path(f"{out}.parts") / "manifest.json").read_text())


def test_rows_are_checkpointed_once_the_oldest_started_commit_every_ago(tmp_path):
    out = tmp_path / "out.parquet"
    store = PartStore(str(out), "parquet", DIM, {"inputs": []})
    store.start_fresh()
    now = [0.0]
    writer = Writer(store, [_Pool()], RejectCounter(), clock=lambda: int((T0 + now[0]) * 1e9), commit_every_s=5.0)
    window = _window(batches=4)
    values = np.arange(6 * DIM, dtype=np.float32).reshape(6, DIM) / 7

    now[0] = 1.0  # the first batch (started at 0 s) lands: 1 s of work is not worth a checkpoint
    list(writer.process(_landed(window, 0, [4, 1], 0.0, values)))
    assert "partial" not in _manifest(out) and writer.checkpoints == 0

    now[0] = 4.9  # still under 5 s since the oldest landed row started
    list(writer.process(_landed(window, 1, [0, 5], 2.0, values)))
    assert "partial" not in _manifest(out)

    now[0] = 5.0  # 5 s since the oldest started: the rows landed so far are checkpointed
    list(writer.process(_landed(window, 2, [2], 4.0, values)))
    partial = _manifest(out)["partial"]
    assert [(p["window"], p["rows"], p["first_row"], p["input_rows"], p["cut_tokens"]) for p in partial] == [
        (0, 5, 0, 6, 64)
    ]
    held = load_held(store)[0]
    assert held.rows.tolist() == [0, 1, 2, 4, 5]
    assert np.array_equal(held.values, values[[0, 1, 2, 4, 5]]) and not held.failed.any()
    chunk = Path(f"{out}.parts") / partial[0]["chunks"][0]
    assert chunk.exists() and _manifest(out)["windows"] == []
    assert store.rows_done == 5

    now[0] = 6.0  # the last row lands: the window is whole, committed, and its checkpoint goes
    list(writer.process(_landed(window, 3, [3], 5.5, values)))
    assert [w["rows"] for w in _manifest(out)["windows"]] == [6]
    assert "partial" not in _manifest(out) and not chunk.exists() and store.rows_done == 6


def test_no_checkpoint_is_written_more_often_than_commit_every(tmp_path):
    store = PartStore(str(tmp_path / "out.parquet"), "parquet", DIM, {"inputs": []})
    store.start_fresh()
    now = [0.0]
    writer = Writer(store, [_Pool()], RejectCounter(), clock=lambda: int((T0 + now[0]) * 1e9), commit_every_s=1.0)
    window = _window(rows=8, batches=8)
    values = np.ones((8, DIM), np.float32)
    for k in range(6):  # a batch every half second, each started long before it landed
        now[0] = 10.0 + 0.5 * k
        list(writer.process(_landed(window, k, [k], 0.0, values)))
    # 10.0 (oldest started at 0), then 11.0 and 12.0 (a second after the last): not every landing
    assert writer.checkpoints == 3
    assert [len(p["chunks"]) for p in _manifest(tmp_path / "out.parquet")["partial"]] == [3]


# -- the planner on a resumed window -------------------------------------------------------------


def _block(lengths: list[int], first_row: int = 0) -> TokenBlock:
    n = len(lengths)
    return TokenBlock(
        block_id=0,
        first_row=first_row,
        input_rows=n,
        ids=list(range(n)),
        flat_ids=np.zeros(sum(lengths), np.int32),
        lengths=np.asarray(lengths, np.int32),
        rows=np.arange(first_row, first_row + n, dtype=np.int64),
        source="in.jsonl",
    )


LENGTHS = [3, 9, 1, 7, 7, 2, 5, 8, 4, 6]
PLAN = PlanConfig(sort_window=10, max_batch_tokens=20, max_batch_size=3, pad_multiple=1)


def _held(rows: list[int], first_row: int = 0, tokens: int = 20) -> Held:
    n = len(rows)
    return Held(first_row, len(LENGTHS), tokens, np.asarray(rows, np.int64), np.zeros((n, DIM)), np.zeros(n, bool))


def test_a_resumed_window_is_cut_as_before_and_skips_the_batches_its_checkpoints_hold():
    full = cut_batches(np.asarray(LENGTHS, np.int32), 20, 3, 1)
    assert len(full) >= 4
    held_rows = sorted(int(r) for rows, _ in full[:2] for r in rows)
    # NOTE: the budget has been lowered since (an out-of-memory split); the window is cut to the held one
    planner = Planner(PLAN, TokenBudget(20, 1), held={0: _held(held_rows)})
    planner.budget.lower(16)
    assert planner.budget.tokens == 8
    batches = list(planner.process(_block(LENGTHS)))
    assert [sorted(b.rows.tolist()) for b in batches] == [sorted(rows.tolist()) for rows, _ in full[2:]]
    assert batches[0].window.num_batches == len(full) - 2 and batches[0].window.cut_tokens == 20


def test_a_window_wholly_held_emits_one_empty_batch_and_one_not_the_same_is_computed_whole():
    planner = Planner(PLAN, held={0: _held(list(range(len(LENGTHS))))})
    batches = list(planner.process(_block(LENGTHS)))
    assert len(batches) == 1 and batches[0].num_rows == 0 and batches[0].window.num_batches == 1

    other = {0: _held([0, 1], first_row=5)}  # checkpointed rows of other input rows: not this window
    batches = list(Planner(PLAN, held=other).process(_block(LENGTHS)))
    assert sum(b.num_rows for b in batches) == len(LENGTHS) and other == {}


# -- options -------------------------------------------------------------------------------------


def test_commit_every_takes_seconds_or_off_and_refuses_what_it_cannot_do():
    assert build_run_config(parsed("run", "in.jsonl", "-o", "o.jsonl"), "run").output.commit_every_s == 30.0
    got = build_run_config(parsed("run", "in.jsonl", "-o", "o.jsonl", "--commit-every", "off"), "run")
    assert got.output.commit_every_s == 0.0
    got = build_run_config(parsed("run", "in.jsonl", "-o", "o.jsonl", "--commit-every", "2.5"), "run")
    assert got.output.commit_every_s == 2.5
    with pytest.raises(Exception, match="neither a number of seconds nor off"):
        parsed("run", "in.jsonl", "-o", "o.jsonl", "--commit-every", "soon")
    with pytest.raises(ConfigError, match="--commit-every must be 0"):
        build_run_config(parsed("run", "in.jsonl", "-o", "o.jsonl", "--commit-every", "-1"), "run").validate()
    ray = parsed("run", "in.jsonl", "-o", "o.jsonl", "--commit-every", "5", "--engine", "ray")
    with pytest.raises(ConfigError, match="on --engine ray a unit"):
        build_run_config(ray, "run").validate()


# -- kill -9 after a checkpoint, then --resume: the uninterrupted output, byte for byte -----------


def _hpcinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def _start(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hpcinfer", "run", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _partial_rows(out: Path) -> int:
    try:
        return sum(p["rows"] for p in _manifest(out).get("partial", []))
    except (OSError, ValueError, KeyError):
        return 0


def _stop_after_a_checkpoint(args: list[str], out: Path, sig: int) -> tuple[subprocess.Popen, str]:
    """Starts a run, waits for its first checkpoint (no window is committed yet), sends `sig`."""
    proc = _start(*args, "-o", str(out))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not _partial_rows(out):
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be stopped"
    assert _manifest(out)["windows"] == [], "one window only: what is kept is the checkpoints'"
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    return proc, stderr


@pytest.fixture(scope="module")
def embed_job(tmp_path_factory, tiny_model):
    """6,000 rows in one window (the default --sort-window), and the uninterrupted output."""
    tmp = tmp_path_factory.mktemp("commit_every")
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(6000, seed=21))]
    rows[77]["text"] = ""  # a reject, so the rejects file is part of what must survive
    src = write_jsonl(tmp / "in.jsonl", rows)
    args = [str(src), "--model", str(tiny_model), "--max-batch-tokens", "512", "--progress", "off", "-q"]
    reference = tmp / "reference.parquet"
    report = tmp / "reference.json"
    done = _hpcinfer(*args, "-o", str(reference), "--commit-every", "off", "--report", str(report))
    assert done.returncode == 0, done.stderr
    return tmp, args, reference, json.loads(report.read_text())


def test_embedding_killed_after_a_checkpoint_resumes_to_the_uninterrupted_bytes(embed_job):
    tmp, args, reference, ref_report = embed_job
    args = [*args, "--commit-every", "0.25"]
    out = tmp / "killed.parquet"
    proc, _ = _stop_after_a_checkpoint(args, out, signal.SIGKILL)
    assert proc.returncode == -9
    kept = _partial_rows(out)
    assert 0 < kept < 6000
    report_path = tmp / "resumed.json"
    done = _hpcinfer(*args, "-o", str(out), "--resume", "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference.read_bytes()
    assert Path(f"{out}.rejects.jsonl").read_bytes() == Path(f"{reference}.rejects.jsonl").read_bytes()
    assert not Path(f"{out}.parts").exists()
    report = json.loads(report_path.read_text())
    assert report["rows_resumed"] == kept  # taken back, not computed again
    assert report["batches"] < ref_report["batches"]
    assert report["accounting"]["rows_read"] == 6000 and report["accounting"]["balanced"]


def test_ctrl_c_inside_a_window_keeps_what_landed(embed_job):
    tmp, args, reference, _ = embed_job
    args = [*args, "--commit-every", "0.25"]
    out = tmp / "interrupted.parquet"
    proc, stderr = _stop_after_a_checkpoint(args, out, signal.SIGINT)
    assert proc.returncode == 130, stderr
    kept = _partial_rows(out)
    assert f"interrupted: {kept:,} rows are committed" in stderr and kept > 0
    done = _hpcinfer(*args, "-o", str(out), "--resume")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference.read_bytes()


def test_resume_of_a_complete_output_says_so_and_exits_0(embed_job):
    tmp, args, reference, _ = embed_job
    before = reference.read_bytes()
    done = _hpcinfer(*args, "-o", str(reference), "--resume")
    assert done.returncode == 0, done.stderr
    assert "output exists and is complete: nothing to resume" in done.stderr
    assert "error" not in done.stderr and reference.read_bytes() == before


@pytest.mark.usefixtures("one_torch_thread")
def test_generation_killed_after_a_checkpoint_resumes_to_the_uninterrupted_bytes(tmp_path):
    ckpt = build_tiny_decoder(tmp_path / "ckpt", "Qwen2ForCausalLM", seed=4, max_positions=128)
    rows = []
    for i, t in enumerate(make_texts(60, seed=8)):
        row = {"id": f"r{i}", "prompt": t, "max_tokens": 6 + i % 9}
        if i % 3 == 1:
            row.update(temperature=0.9, top_p=0.9, seed=i)
        elif i % 3 == 2:
            row.update(temperature=1.0)  # unseeded: the run seed and the row number decide
        rows.append(row)
    rows[13]["top_k"] = -1  # a reject that must survive the kill
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    args = [str(src), "--model", str(ckpt), "--max-num-seqs", "2", "--threads", "1", "--kv-cache-memory", "8MiB"]
    args += ["--progress", "off", "-q", "--commit-every", "0.2"]  # one window: --window-rows 512
    ref = tmp_path / "ref.jsonl"
    assert _hpcinfer(*args, "-o", str(ref)).returncode == 0
    out = tmp_path / "out.jsonl"
    proc, _ = _stop_after_a_checkpoint(args, out, signal.SIGKILL)
    assert proc.returncode == -9
    kept = _partial_rows(out)
    assert 0 < kept < 59
    report_path = tmp_path / "resumed.json"
    done = _hpcinfer(*args, "-o", str(out), "--resume", "--report", str(report_path))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == ref.read_bytes()
    assert Path(f"{out}.rejects.jsonl").read_bytes() == Path(f"{ref}.rejects.jsonl").read_bytes()
    report = json.loads(report_path.read_text())
    assert report["rows_resumed"] == kept and report["accounting"]["balanced"]
