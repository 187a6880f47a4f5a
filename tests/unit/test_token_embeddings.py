"""--output-value token_embeddings against sentence-transformers' own
`encode(texts, output_value="token_embeddings")` on the same tiny random checkpoints: every row's
token states (special tokens included, padding not), in input order, Parquet and JSONL, rows past
the checkpoint's limit truncated as it truncates them; a Dense module (which acts on the sentence
embedding only) changes nothing; resume; the refusals, one line each."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.dense import Dense
from sentence_transformers.base.modules.normalize import Normalize

from hpcinfer.api import run
from hpcinfer.config import PlanConfig
from hpcinfer.errors import ConfigError, ModelError
from hpcinfer.obs.progress import Progress
from hpcinfer.tasks.embed.task import TASK
from tests.fixtures.tiny import build_tiny_bert

from ..conftest import (
    assert_a_late_fault_resumes_to_the_whole_run,
    make_texts,
    run_job,
    small_config,
    write_jsonl,
)

ROWS = 120
TEXTS = make_texts(ROWS, seed=13)
TOKENS = {"output_value": "token_embeddings"}


def token_run(tmp_path, model, name: str, **over) -> pa.Table:
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(TEXTS)])
    return run_job(small_config(src, tmp_path / name, model, embed=TOKENS, **over))[1]


def sentence_transformers_tokens(model) -> list[np.ndarray]:
    st = SentenceTransformer(str(model), device="cpu")
    return [t.numpy() for t in st.encode(TEXTS, output_value="token_embeddings", batch_size=16)]


def assert_equal_tokens(table: pa.Table, theirs: list[np.ndarray], dim: int) -> float:
    """Every row's [n_tokens, dim] states equal sentence-transformers' (same counts); the largest difference."""
    assert table.column_names == ["id", "token_embeddings"]
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(ROWS)]
    ours = [np.asarray(row, np.float32) for row in table.column("token_embeddings").to_pylist()]
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    assert all(o.shape[1] == dim for o in ours)
    worst = max(float(np.abs(o - t).max()) for o, t in zip(ours, theirs, strict=True))
    assert worst <= 1e-5
    return worst


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_token_embeddings_equal_sentence_transformers(tmp_path, tiny_model, fmt, one_torch_thread):
    table = token_run(tmp_path, tiny_model, f"out.{fmt}")
    if fmt == "parquet":
        assert table.schema.field("token_embeddings").type == pa.list_(pa.list_(pa.float32(), 32))
    assert_equal_tokens(table, sentence_transformers_tokens(tiny_model), 32)


def test_rows_past_the_limit_are_truncated_as_sentence_transformers_truncates(tmp_path, one_torch_thread):
    model = build_tiny_bert(tmp_path / "short", max_seq_length=24, seed=3)
    table = token_run(tmp_path, model, "out.parquet")
    theirs = sentence_transformers_tokens(model)
    assert sum(len(t) == 24 for t in theirs) >= 20  # NOTE: many rows really are cut at the limit
    assert_equal_tokens(table, theirs, 32)


def save_with(tmp_path, tiny_model, name: str, module) -> object:  # noqa: ANN001
    """The tiny checkpoint saved again by sentence-transformers with one more module after its own."""
    st = SentenceTransformer(str(tiny_model), device="cpu")
    torch.manual_seed(0)
    SentenceTransformer(modules=[*st, module], device="cpu").save(str(tmp_path / name))
    return tmp_path / name


def test_a_dense_module_leaves_the_token_embeddings_alone(tmp_path, tiny_model, one_torch_thread):
    model = save_with(tmp_path, tiny_model, "dense", Dense(32, 8))
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((model / "modules.json").read_text())]
    assert "Dense" in modules and "Normalize" in modules
    assert_equal_tokens(token_run(tmp_path, model, "out.parquet"), sentence_transformers_tokens(model), 32)


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, tiny_model, one_torch_thread):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    plan = {"sort_window": 40, "max_batch_tokens": 1024, "max_batch_size": 32}
    assert_a_late_fault_resumes_to_the_whole_run(tmp_path, src, tiny_model, plan=plan, embed=TOKENS)


def test_the_default_window_is_cut_to_a_gibibyte(tmp_path, tiny_model):
    """A window of rows at their longest (256 tokens of 32 float32 states) holds at most 1 GiB."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "hi"}])
    cfg = small_config(src, tmp_path / "out.parquet", tiny_model, embed=TOKENS)
    settled = TASK.settle(replace(cfg, plan=PlanConfig()))
    assert settled.plan.sort_window == (1 << 30) // (256 * 32 * 4)
    assert TASK.settle(cfg).plan.sort_window == 120  # NOTE: a window the run sets is kept
    assert TASK.fingerprint(cfg)["output_value"] == "token_embeddings"
    assert TASK.fingerprint(replace(cfg, embed=replace(cfg.embed, output_value="sentence_embedding"))) == {
        "precision": None,
        "calibration": None,
        "output_value": None,
        "outputs": None,
    }


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"embed": {**TOKENS, "precision": "int8"}}, "--precision int8 quantizes sentence embeddings"),
        ({"embed": {**TOKENS, "dimensions": 8}}, "--dimensions truncates the sentence embedding"),
        ({"embed": {**TOKENS, "pooling": "cls"}}, "--pooling makes the sentence embedding"),
        ({"embed": {**TOKENS, "normalize": False}}, "--normalize/--no-normalize apply to the sentence embedding"),
        ({"embed": TOKENS, "backend": "transformers"}, "--backend transformers: token embeddings run"),
        ({"embed": TOKENS, "device": {"quantize": "int8"}}, "--quantize int8: token embeddings run float weights"),
        ({"embed": TOKENS, "task": "classify"}, "--task classify does not read --output-value"),
        ({"embed": {"output_value": "tokens"}}, "--output-value must be one of"),
    ],
)
def test_refusals_are_one_line(tmp_path, tiny_model, over, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "hi"}])
    cfg = small_config(src, tmp_path / "out.parquet", tiny_model, **over)
    with pytest.raises(ConfigError, match=message) as caught:
        run(cfg, progress=Progress("off"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out.parquet").exists()


def test_an_openai_batch_input_is_refused(tmp_path, tiny_model):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hi"}}
    src = write_jsonl(tmp_path / "req.jsonl", [line])
    with pytest.raises(ConfigError, match="an OpenAI batch file has no token-embedding endpoint"):
        run(small_config(src, tmp_path / "out.jsonl", tiny_model, embed=TOKENS), progress=Progress("off"))


def test_a_decoder_embedder_is_refused(tmp_path, tiny_model):
    model = tmp_path / "decoder"
    model.mkdir()
    shutil.copy(tiny_model / "tokenizer.json", model / "tokenizer.json")
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3Model"]}))
    (model / "model.safetensors").write_bytes(b"")  # NOTE: refused before any weight is read
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "hi"}])
    cfg = small_config(src, tmp_path / "out.parquet", model, task="embed", embed=TOKENS)
    with pytest.raises(ConfigError, match="a decoder embedder \\(qwen3\\) gives sentence embeddings only"):
        run(cfg, progress=Progress("off"))


def test_a_module_that_acts_on_the_token_embeddings_is_refused(tmp_path, tiny_model):
    model = save_with(tmp_path, tiny_model, "normalized", Normalize(module_input_name="token_embeddings"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "hi"}])
    with pytest.raises(ModelError, match="the Normalize module acts on the token embeddings") as caught:
        run(small_config(src, tmp_path / "out.parquet", model, embed=TOKENS), progress=Progress("off"))
    assert "\n" not in str(caught.value)
