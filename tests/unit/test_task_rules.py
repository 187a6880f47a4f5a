"""Rules both tasks share: one --dtype auto, ids kept as integers, one duplicate-id rule (local and on Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.device import resolve_dtype
from hpcinfer.device.simulated import SimulatedDevice
from hpcinfer.files.ids import IdSet, id_key
from hpcinfer.pipeline.job import run_embed
from hpcinfer.tasks.generate.cluster import drop_repeated_requests
from hpcinfer.tasks.generate.job import run_generate
from hpcinfer.tasks.generate.setup import generation_devices
from hpcinfer.types import Reject
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import write_jsonl


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("rules"), "LlamaForCausalLM", seed=2, max_positions=64)


def generate_config(src: Path, out: Path, model: Path, **device) -> RunConfig:
    return RunConfig(
        input=InputConfig((str(src),)),
        model=str(model),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(**device),
        generate=GenerateConfig(max_tokens=2, window_rows=3, kv_cache_memory="4MiB"),
    )


def test_dtype_auto_is_one_rule_for_both_tasks(tmp_path, tiny_model, ckpt, monkeypatch):
    # On the simulated device (it computes on the CPU) both tasks run in float32.
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "a b", "prompt": "a b"}])
    out = OutputConfig(str(tmp_path / "e.jsonl"))
    config = RunConfig(input=InputConfig((str(src),)), model=str(tiny_model), output=out)
    embedded = run_embed(config, device=SimulatedDevice(1))
    generated = run_generate(generate_config(src, tmp_path / "g.jsonl", ckpt))
    assert embedded.dtype == generated.dtype == "float32"
    # On a GPU without bfloat16 both take float16 (the rule is asked, no GPU needed).
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = SimulatedDevice(1)
    gpu.kind, gpu.torch_device = "cuda", torch.device("cuda:0")
    cfg = generate_config(src, tmp_path / "x.jsonl", ckpt, device="cuda:0")
    assert resolve_dtype("auto", gpu) == generation_devices(cfg)[1] == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", gpu) == generation_devices(cfg)[1] == torch.bfloat16


def test_generation_keeps_integer_ids_integers(tmp_path, ckpt):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i * 10, "prompt": f"p {i}"} for i in range(7)])
    for suffix in ("parquet", "jsonl"):
        out = tmp_path / f"out.{suffix}"
        run_generate(generate_config(src, out, ckpt))
        if suffix == "parquet":
            assert pq.read_table(out).column("id").to_pylist() == [i * 10 for i in range(7)]
            assert str(pq.read_schema(out).field("id").type) == "int64"
        else:
            assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [i * 10 for i in range(7)]


def test_an_id_is_taken_by_its_first_row_whatever_its_fate(tmp_path, ckpt):
    """Embedding's rule: the id check comes before the prompt's, so a row rejected for its prompt
    still takes its id, and a later row with that id is a duplicate."""
    rows = [{"id": "a", "prompt": "word " * 200}, {"id": "a", "prompt": "short"}, {"id": "b", "prompt": "fine"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_generate(generate_config(src, out, ckpt))
    rejects = [json.loads(x) for x in Path(f"{out}.rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [("a", "too_long"), ("a", "duplicate_id")]
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["b"]


def test_the_ray_driver_applies_the_same_rule_to_rows_its_replica_rejected():
    seen = IdSet()
    seen.update([id_key("a")])  # an earlier window's id
    too_long = Reject(7, "f.jsonl", 8, "a", "too_long", "prompt of 300 tokens", 7).to_json()
    answers = [(8, {"id": "b", "text": "x"})]
    admitted = [(7, "a", 8, "f.jsonl", 7), (8, "b", 9, "f.jsonl", 8)]
    kept, rejects, moved = drop_repeated_requests(seen, answers, [too_long], admitted)
    assert kept == answers and moved == {}
    assert [(r["row"], r["reason"]) for r in rejects] == [(7, "duplicate_id")]
