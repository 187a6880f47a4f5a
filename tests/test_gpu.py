"""CUDA checks: run by benchmarks/gpu_check.sh on a GPU machine; skipped where there is no CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcinfer.device import StagingRing

from .conftest import run_job, small_config

pytestmark = pytest.mark.gpu


def _emb(table) -> np.ndarray:
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)


@pytest.fixture()
def cpu_reference(tmp_path, tiny_model, requests_jsonl):
    _, table = run_job(small_config(requests_jsonl, tmp_path / "cpu.parquet", tiny_model, device={"device": "cpu"}))
    return _emb(table)


@pytest.mark.parametrize(("buffers", "streams"), [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_cuda_float32_equals_cpu(tmp_path, tiny_model, requests_jsonl, cpu_reference, buffers, streams):
    cfg = small_config(
        requests_jsonl,
        tmp_path / "gpu.parquet",
        tiny_model,
        device={"device": "cuda", "dtype": "float32", "staging_buffers": buffers, "streams": streams},
    )
    _, table = run_job(cfg)
    np.testing.assert_allclose(_emb(table), cpu_reference, rtol=1e-4, atol=1e-4)


def test_staging_slots_are_never_reused_before_their_copy(tmp_path, tiny_model, requests_jsonl, monkeypatch):
    seen: list[bool] = []
    original = StagingRing.acquire

    def checked(self):  # noqa: ANN001, ANN202
        slot = original(self)
        if slot.h2d_done is not None:
            seen.append(slot.h2d_done._event.query())  # must be complete once acquire returns
        return slot

    monkeypatch.setattr(StagingRing, "acquire", checked)
    cfg = small_config(requests_jsonl, tmp_path / "gpu.parquet", tiny_model, device={"device": "cuda"})
    run_job(cfg)
    assert seen and all(seen)


def test_cuda_graphs_equal_eager(tmp_path, tiny_model, requests_jsonl):
    eager_cfg = small_config(requests_jsonl, tmp_path / "eager.parquet", tiny_model, device={"device": "cuda"})
    graph_cfg = small_config(
        requests_jsonl, tmp_path / "graph.parquet", tiny_model, device={"device": "cuda", "cuda_graphs": True}
    )
    _, eager = run_job(eager_cfg)
    _, graphs = run_job(graph_cfg)
    assert eager.column("id").to_pylist() == graphs.column("id").to_pylist()
    np.testing.assert_allclose(_emb(graphs), _emb(eager), rtol=2e-2, atol=2e-3)


def test_default_model_bfloat16_close_to_float32(tmp_path, requests_jsonl):
    outs = {}
    for dtype in ("float32", "auto"):
        cfg = small_config(
            requests_jsonl, tmp_path / f"{dtype}.parquet", "default", device={"device": "cuda", "dtype": dtype}
        )
        outs[dtype] = _emb(run_job(cfg)[1])
    cos = (outs["float32"] * outs["auto"]).sum(1)
    assert cos.min() > 0.999
    assert torch.cuda.is_available()
