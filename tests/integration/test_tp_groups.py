"""`--tp N` with `--devices` of several groups: 4 CPU devices with `--tp 2` run 2 groups of 2 ranks,
each rank 0 an engine of the several-device pool; the answers (greedy and seeded) equal one
process's, and the report shows both groups' work."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from hpcinfer.config import DeviceConfig
from hpcinfer.errors import ConfigError
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import write_jsonl
from .test_tp_generate import _config, _rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("tp"), "Qwen2ForCausalLM", seed=4, max_positions=128)


def test_two_groups_of_two_ranks_write_what_one_process_writes(tmp_path, ckpt, children_left):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(10))
    run_generate(_config(src, tmp_path / "ref.jsonl", ckpt))
    config = _config(src, tmp_path / "tp.jsonl", ckpt, tp=2, window_rows=5, max_num_seqs=2)
    report = run_generate(replace(config, device=replace(config.device, devices="cpu,cpu,cpu,cpu")))
    assert (tmp_path / "tp.jsonl").read_text() == (tmp_path / "ref.jsonl").read_text()
    assert [(r["group"], r["rank"]) for r in report.tensor_parallel] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["steps"] > 0 and r["collective_calls"] > 0 for r in report.tensor_parallel)
    assert [d["device"] for d in report.devices] == ["cpu#0", "cpu#1"]
    assert all(d["rows"] > 0 and d["steps"] > 0 for d in report.devices), report.devices
    assert sum(d["rows"] for d in report.devices) == report.rows
    assert not children_left(), "every group's ranks ended"


def test_a_device_count_that_does_not_divide_is_one_line(tmp_path, ckpt):
    src = write_jsonl(tmp_path / "in.jsonl", _rows(2))
    config = _config(src, tmp_path / "o.jsonl", ckpt)
    config = replace(config, device=DeviceConfig(tensor_parallel=2, devices="cpu,cpu,cpu"))
    with pytest.raises(ConfigError, match=re.escape("--tp 2 with --devices of 3 devices: give a multiple of 2")):
        run_generate(config)
