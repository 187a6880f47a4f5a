"""`hpcinfer run --tp 2` on a tiny causal LM: 2 gloo ranks write what one process writes; a rank
killed mid-run ends the run naming it, with its committed windows kept for --resume; Ctrl-C stops
every rank; combinations not built are refused in one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from hpcinfer.api import run
from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.errors import ConfigError
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
BASE = ["--progress", "off", "-q", "--threads", "2", "--kv-cache-memory", "8MiB"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("tp"), "Qwen2ForCausalLM", seed=4, max_positions=128)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcinfer", "run", *args]


def _rows(count: int) -> list[dict]:
    rows = []
    for i, t in enumerate(make_texts(count, seed=8)):
        row = {"id": f"r{i}", "prompt": t, "max_tokens": 4 + i % 9}
        if i % 3 == 1:
            row.update(temperature=0.9, top_p=0.9, seed=i)
        elif i % 3 == 2:
            row.update(temperature=1.0)  # unseeded: the run seed and the row number decide
        rows.append(row)
    rows[min(5, count - 1)]["top_k"] = -1  # a reject
    return rows


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cli(*args), env=ENV, capture_output=True, text=True, timeout=timeout)


def _config(src: Path, out: Path, model: Path, tp: int = 1, **gen: object) -> RunConfig:
    return RunConfig(
        input=InputConfig((str(src),)),
        model=str(model),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(tensor_parallel=tp, threads=2),
        generate=GenerateConfig(**{"window_rows": 4, "max_num_seqs": 4, "kv_cache_memory": "8MiB", **gen}),
    )


def test_two_ranks_write_what_one_process_writes(tmp_path, ckpt):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(16))
    run_generate(_config(src, tmp_path / "ref.jsonl", ckpt))
    report = run_generate(_config(src, tmp_path / "tp.jsonl", ckpt, tp=2))
    assert (tmp_path / "tp.jsonl").read_text() == (tmp_path / "ref.jsonl").read_text()
    # n = 2: every answer forks its sequence, whose last, partly filled KV block is copied on every rank
    few = write_jsonl(tmp_path / "few.jsonl", _rows(3))
    run_generate(_config(few, tmp_path / "ref2.jsonl", ckpt, n=2, max_num_seqs=8))
    run_generate(_config(few, tmp_path / "tp2.jsonl", ckpt, tp=2, n=2, max_num_seqs=8))
    assert (tmp_path / "tp2.jsonl").read_text() == (tmp_path / "ref2.jsonl").read_text()
    assert [r["rank"] for r in report.tensor_parallel] == [0, 1]
    for r in report.tensor_parallel:
        assert r["weight_bytes"] > 0 and r["kv_pool_bytes"] == 8 << 20 and r["rss_after_load_bytes"] > 0
        assert r["collective_calls"] > r["steps"] > 0 and r["collective_s"] > 0


def test_a_gemma3_on_two_ranks_with_paged_windows_writes_what_one_process_writes(tmp_path):
    """Gemma 3's sliding-window layers (a window of 8, crossed by every prompt and answer) page their
    blocks on every rank as on one: the tables and the forks' copies of local blocks go with each step."""
    windows = {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    ckpt = build_tiny_decoder(tmp_path / "gemma3", "Gemma3ForCausalLM", seed=4, max_positions=128, **windows)
    rows = _rows(8)
    for row in rows[:3]:
        row["n"] = 2  # forks: their last, partly filled blocks (full and local) copied on every rank
    src = write_jsonl(tmp_path / "in.jsonl", [{**r, "max_tokens": 24} for r in rows])
    run_generate(_config(src, tmp_path / "ref.jsonl", ckpt, max_num_seqs=8))
    report = run_generate(_config(src, tmp_path / "tp.jsonl", ckpt, tp=2, max_num_seqs=8))
    assert (tmp_path / "tp.jsonl").read_text() == (tmp_path / "ref.jsonl").read_text()
    assert report.peak_kv_blocks_full_attention > report.peak_kv_blocks > 0  # the windows were paged


def _start_until_committed(args: list[str], manifest: Path, windows: int, env: dict = ENV) -> subprocess.Popen[str]:
    proc = subprocess.Popen(_cli(*args), env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len(json.loads(manifest.read_text())["windows"]) >= windows:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be stopped"
    return proc


def test_a_rank_killed_ends_the_run_and_resume_finishes_it(tmp_path, ckpt):
    """kill -9 of rank 1, then of rank 0 in the resumed run; a last --resume writes what one process
    writes. Nothing stays in the temporary folder: rank 0 removes its stats folder when rank 1 dies,
    and the next run removes the one a killed rank 0 left."""
    src = write_jsonl(tmp_path / "in.jsonl", _rows(36))
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**ENV, "TMPDIR": str(temp)}
    ref = tmp_path / "ref.jsonl"
    run_generate(_config(src, ref, ckpt, window_rows=3, max_num_seqs=2))
    args = [str(src), "--model", str(ckpt), "--window-rows", "3", "--max-num-seqs", "2", "--tp", "2", *BASE]
    out = tmp_path / "out.jsonl"
    manifest = Path(str(out) + ".parts") / "manifest.json"
    for victim, windows, more in ((1, 2, []), (0, 5, ["--resume"])):
        proc = _start_until_committed([*args, "-o", str(out), *more], manifest, windows, env)
        rank1 = psutil.Process(proc.pid).children()[0]
        (rank1 if victim == 1 else psutil.Process(proc.pid)).send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
        rank1.wait(timeout=30)  # no rank is left behind
        if victim == 1:
            assert not list(temp.glob("hpcinfer-*")), list(temp.iterdir())
            assert proc.returncode == 1, stderr
            assert "tensor-parallel rank 1 (cpu) died (killed by SIGKILL)" in stderr and "--resume" in stderr
            assert "Traceback" not in stderr
        assert windows <= len(json.loads(manifest.read_text())["windows"]) < 12
    done = subprocess.run(_cli(*args, "-o", str(out), "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not list(temp.glob("hpcinfer-*")), list(temp.iterdir())
    assert out.read_text() == ref.read_text()
    assert Path(str(out) + ".rejects.jsonl").read_text() == Path(str(ref) + ".rejects.jsonl").read_text()


def test_ctrl_c_stops_every_rank(tmp_path, ckpt):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(48))
    out = tmp_path / "out.jsonl"
    args = [str(src), "--model", str(ckpt), "--window-rows", "2", "--max-num-seqs", "2", "--tp", "2", *BASE]
    proc = _start_until_committed([*args, "-o", str(out)], Path(str(out) + ".parts") / "manifest.json", 1)
    rank1 = psutil.Process(proc.pid).children()[0]
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "rows are committed" in stderr and "--resume" in stderr
    rank1.wait(timeout=30)


def test_a_model_that_does_not_divide_is_one_line(tmp_path, ckpt):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(2))
    done = _run(str(src), "--model", str(ckpt), "-o", str(tmp_path / "o.jsonl"), *BASE, "--tp", "4", timeout=120)
    assert done.returncode == 2 and "--tp 4 must divide the model's KV heads (2)" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("device", "task", "says"),
    [
        (DeviceConfig(tensor_parallel=2), "classify", "--tp splits a decoder (generation, decoder embedders)"),
        (DeviceConfig(tensor_parallel=2, devices="cpu,cpu,cpu"), "auto", "--tp 2 with --devices of 3 devices"),
        (DeviceConfig(tensor_parallel=2, quantize="fp8"), "auto", "--quantize fp8 with --tp is not built yet"),
        (DeviceConfig(tensor_parallel=0), "auto", "--tp must be at least 1"),
    ],
)
def test_what_is_not_built_is_refused(tmp_path, ckpt, device, task, says):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(2))
    config = replace(_config(src, tmp_path / "o.jsonl", ckpt), device=device, task=task)
    with pytest.raises(ConfigError, match=re.escape(says)):
        run(config)
