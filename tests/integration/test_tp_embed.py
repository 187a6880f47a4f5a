"""`--tp 2` on a decoder embedder (`--task embed`): the embedding pipeline on rank 0's shard, rank 1
replaying each batch's forward; the embeddings equal one process's (float32 rounding), what is not
built is refused in one line, and no rank outlives the run."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from hpcinfer.api import run
from hpcinfer.config import DeviceConfig, InputConfig, OutputConfig, PipelineConfig, PlanConfig, RunConfig
from hpcinfer.errors import ConfigError
from tests.fixtures.tiny_decoder import add_sentence_transformers_files, build_tiny_decoder

from ..conftest import make_texts, read_output, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = build_tiny_decoder(tmp_path_factory.mktemp("tpe"), "Qwen3ForCausalLM", seed=6, max_positions=128)
    return add_sentence_transformers_files(path, "last", normalize=True, max_seq_length=64)


def _config(src, out, model, **device) -> RunConfig:
    return RunConfig(
        input=InputConfig((str(src),)),
        model=str(model),
        task="embed",
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        plan=PlanConfig(sort_window=16, max_batch_tokens=512),
        device=DeviceConfig(**device),
    )


def test_two_ranks_embed_as_one_process(tmp_path, embedder, children_left):
    rows = [{"id": i, "text": t[: 20 + 7 * i]} for i, t in enumerate(make_texts(24, seed=8))]
    rows.append({"id": 99, "text": ""})  # a reject, the same with --tp
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    one = run(_config(src, tmp_path / "one.parquet", embedder))
    two = run(_config(src, tmp_path / "two.parquet", embedder, tensor_parallel=2))
    a, b = read_output(tmp_path / "one.parquet"), read_output(tmp_path / "two.parquet")
    assert a.column("id").to_pylist() == b.column("id").to_pylist() and two.rows == one.rows == 24
    ea = np.stack(a.column("embedding").to_numpy(zero_copy_only=False))
    eb = np.stack(b.column("embedding").to_numpy(zero_copy_only=False))
    assert np.abs(ea - eb).max() <= 1e-5
    assert two.rejects == one.rejects == {"empty_text": 1}
    ranks = two.tensor_parallel
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["steps"] == ranks[1]["steps"] == two.batches > 0
    assert all(r["collective_calls"] > 0 and r["weight_bytes"] > 0 for r in ranks)
    assert not children_left(), "rank 1 ended with the run"


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ({"quantize": "int8"}, "--quantize int8 with --tp is not built yet"),
        ({"devices": "cpu,cpu"}, "a pooling task runs one tensor-parallel group"),
        ({"tensor_parallel": 3}, "--tp 3 must divide"),
    ],
)
def test_what_is_not_built_is_refused(tmp_path, embedder, device, says, children_left):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "a short text"}])
    config = _config(src, tmp_path / "o.parquet", embedder, **{"tensor_parallel": 2, **device})
    with pytest.raises(ConfigError, match=re.escape(says)):
        run(config)
    assert not children_left()


def test_an_encoder_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "a short text"}])
    config = replace(_config(src, tmp_path / "o.parquet", "default", tensor_parallel=2))
    with pytest.raises(ConfigError, match="splits a decoder; this checkpoint is an encoder"):
        run(config)
