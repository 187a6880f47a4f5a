"""`hpcinfer profile`: NVTX ranges per stage per batch, balanced even on failure; torch trace."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest

from hpcinfer.api import run
from hpcinfer.errors import StageError
from hpcinfer.obs.profile import RecordingRanges
from hpcinfer.obs.progress import Progress

from ..conftest import small_config


def _balanced(events) -> dict[str, list[str]]:
    """Per thread: every push has its pop, in stack order; returns the names pushed per thread."""
    stacks: dict[str, list[str]] = {}
    pushed: dict[str, list[str]] = {}
    for thread, kind, name in events:
        stack = stacks.setdefault(thread, [])
        if kind == "push":
            stack.append(name)
            pushed.setdefault(thread, []).append(name)
        else:
            assert stack, f"pop without push on {thread}"
            stack.pop()
    assert all(not s for s in stacks.values()), stacks
    return pushed


@pytest.mark.parametrize("overlap", [True, False])
def test_one_range_per_stage_per_batch(tmp_path, tiny_model, requests_jsonl, overlap):
    ranges = RecordingRanges()
    cfg = small_config(requests_jsonl, tmp_path / "out.parquet", tiny_model, pipeline={"overlap": overlap})
    report = run(cfg, progress=Progress("off"), ranges=ranges)
    pushed = [n for names in _balanced(ranges.events).values() for n in names]
    for stage in ("stage", "execute", "write"):
        batches = Counter(int(m[1]) for n in pushed if (m := re.match(rf"hpcinfer/{stage} batch=(\d+) ", n)))
        assert sorted(batches) == list(range(report.batches)) and set(batches.values()) == {1}, stage
    assert any(re.fullmatch(r"hpcinfer/execute batch=\d+ rows=\d+ tokens=\d+", n) for n in pushed)
    blocks = Counter(int(m[1]) for n in pushed if (m := re.match(r"hpcinfer/tokenize block=(\d+) ", n)))
    assert blocks and set(blocks.values()) == {1}
    assert sum(n == "hpcinfer/read" for n in pushed) == len(blocks) + 1  # the last call finds the end


@pytest.mark.parametrize("stage", ["tokenize", "execute", "write"])
def test_ranges_are_closed_when_a_stage_fails(tmp_path, tiny_model, requests_jsonl, stage):
    ranges = RecordingRanges()

    def fault(_item) -> None:
        raise RuntimeError("injected")

    with pytest.raises(StageError):
        run(
            small_config(requests_jsonl, tmp_path / "o.parquet", tiny_model),
            progress=Progress("off"),
            ranges=ranges,
            hooks={stage: fault},
        )
    _balanced(ranges.events)


def test_profile_command_writes_traces_and_prints_nsys(tmp_path, tiny_model, requests_jsonl):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcinfer",
            "profile",
            str(requests_jsonl),
            "-o",
            str(tmp_path / "o.parquet"),
            "--model",
            str(tiny_model),
            "--limit",
            "200",
            "--max-batch-tokens",
            "512",
            "--progress",
            "off",
            "--torch-profile",
            str(tmp_path / "prof"),
            "--trace",
            str(tmp_path / "trace.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "nsys profile -t cuda,nvtx,osrt" in proc.stderr
    assert "where the time went" in proc.stderr
    torch_trace = json.loads((tmp_path / "prof" / "torch-trace.json").read_text())
    assert any("aten::" in e.get("name", "") for e in torch_trace["traceEvents"])
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    import pyarrow.parquet as pq

    assert pq.read_metadata(tmp_path / "o.parquet").num_rows == 200
