"""--task sparse against sentence-transformers' own `SparseEncoder.encode` on tiny random SPLADE
checkpoints (an MLMTransformer over a transformers BertForMaskedLM, then SpladePooling) saved by the
installed sentence-transformers: each row's non-zero vocabulary entries through the whole encoder
pipeline, rows past the limit included; resume, `--task auto` and the task's refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers

from hpcinfer.api import run
from hpcinfer.errors import ConfigError
from hpcinfer.obs.progress import Progress
from hpcinfer.registry import auto_task
from tests.fixtures.tiny_classifier import build_tiny_classifier

from ..conftest import (
    assert_a_late_fault_resumes_to_the_whole_run,
    make_texts,
    run_job,
    small_config,
    write_jsonl,
)

MAX_SEQ_LENGTH = 48  # make_texts' rows run to 80 words: many are cut


def build_splade(path, seed: int = 0, strategy: str = "max", activation: str = "relu", bias: float = -5.0,
                 max_active_dims: int | None = None, family: str = "bert"):  # fmt: skip
    """A random SPLADE SparseEncoder saved by sentence-transformers, with the packaged MiniLM tokenizer.
    `bias`: the MLM decoder's bias, negative so each row keeps a few hundred of its 30522 entries;
    `family`: bert, or xlm-roberta (positions from padding_idx + 1, RoBERTa's lm_head)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    tokenizer_from = build_tiny_classifier(path.parent / f"{path.name}-tokenizer", seed=seed)
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    vocab = transformers.AutoConfig.from_pretrained(tokenizer_from).vocab_size
    torch.manual_seed(seed)
    if family == "bert":
        model = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=vocab, **shape)).eval()
    else:
        config = transformers.XLMRobertaConfig(vocab_size=vocab, max_position_embeddings=MAX_SEQ_LENGTH + 2,
                                               pad_token_id=1, type_vocab_size=1, **shape)  # fmt: skip
        model = transformers.XLMRobertaForMaskedLM(config).eval()
    with torch.no_grad():  # NOTE: wider than the default init, so logits spread over the vocabulary
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        (model.cls.predictions if family == "bert" else model.lm_head).bias.fill_(bias)
    raw = path.parent / f"{path.name}-mlm"
    model.save_pretrained(raw, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, raw / name)
    mlm = MLMTransformer(str(raw), max_seq_length=MAX_SEQ_LENGTH)
    pooling = SpladePooling(pooling_strategy=strategy, activation_function=activation)
    encoder = SparseEncoder(modules=[mlm, pooling], max_active_dims=max_active_dims, device="cpu")
    encoder.save(str(path))
    return path


def dense(table, vocab: int) -> np.ndarray:
    out = np.zeros((table.num_rows, vocab), np.float32)
    for row, (indices, values) in enumerate(zip(table.column("indices").to_pylist(),
                                                table.column("values").to_pylist(), strict=True)):  # fmt: skip
        assert indices == sorted(indices) and len(set(indices)) == len(indices)
        out[row, indices] = values
    return out


def sparse_encoder_vectors(path, texts) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(path), device="cpu")
    return model.encode(texts, batch_size=16, convert_to_tensor=True).coalesce().to_dense().numpy()


@pytest.mark.parametrize(
    "strategy, activation, top_k, rows, family",
    [("max", "relu", None, 300, "bert"), ("sum", "log1p_relu", 12, 60, "bert"),
     ("max", "relu", None, 120, "xlm-roberta")],
)  # fmt: skip
def test_sparse_vectors_equal_sparse_encoder(tmp_path, strategy, activation, top_k, rows, family, one_torch_thread):
    path = build_splade(tmp_path / "m", seed=3, strategy=strategy, activation=activation, max_active_dims=top_k,
                        family=family)  # fmt: skip
    texts = make_texts(rows, seed=11)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])
    report, table = run_job(small_config(src, tmp_path / "out.parquet", path, task="sparse"))
    assert table.column_names == ["id", "indices", "values"]
    assert table.schema.field("indices").type.value_type == pa.int32()
    assert table.schema.field("values").type.value_type == pa.float32()
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(rows)]
    theirs = sparse_encoder_vectors(path, texts)
    ours = dense(table, theirs.shape[1])
    assert [list(np.flatnonzero(r)) for r in ours] == [list(np.flatnonzero(r)) for r in theirs]
    # NOTE: a sum over up to 48 tokens (values in the tens) rounds in float32 by its order: 1e-5 of it
    scale = np.maximum(1.0, np.abs(theirs)) if strategy == "sum" else 1.0
    assert (np.abs(ours - theirs) / scale).max() <= 1e-5
    active = (theirs != 0).sum(axis=1)
    assert active.min() >= 1 and (top_k is None or active.max() == top_k)
    assert sum(len(t.split()) > MAX_SEQ_LENGTH for t in texts) >= rows // 10  # rows past the limit were cut
    assert report.rows == rows


def test_a_row_with_no_entries_is_written_empty(tmp_path, one_torch_thread):
    path = build_splade(tmp_path / "m", seed=1, bias=-1000.0)  # NOTE: every logit < 0: every vector is empty
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "nothing at all"}, {"id": 2, "text": "none"}])
    assert not sparse_encoder_vectors(path, ["nothing at all", "none"]).any()
    _, table = run_job(small_config(src, tmp_path / "out.parquet", path))
    assert table.to_pylist() == [{"id": 1, "indices": [], "values": []}, {"id": 2, "indices": [], "values": []}]
    run_job(small_config(src, tmp_path / "out.jsonl", path))
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert lines == [{"id": 1, "indices": [], "values": []}, {"id": 2, "indices": [], "values": []}]


def test_auto_picks_sparse_and_options_it_ignores_are_refused(tmp_path):
    path = build_splade(tmp_path / "m")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "sparse retrieval"}])
    name, why = auto_task(small_config(src, tmp_path / "o.jsonl", path))
    assert (name, why) == (
        "sparse",
        "sentence-transformers MLMTransformer + SpladePooling modules: a sparse (SPLADE) embedding",
    )
    for over, message in [
        ({"embed": {"pooling": "mean"}}, "--task sparse does not read --pooling"),
        ({"generate": {"max_tokens": 5}}, "--task sparse does not read --max-tokens"),
        ({"backend": "transformers"}, "--task sparse runs hpcinfer's own BERT encoder"),
        ({"device": {"quantize": "int8"}}, "--task sparse runs float weights"),
        ({"generate": {"top_k": 7}}, "--task sparse does not read --top-k: --max-active-dims keeps"),
        ({"sparse": {"max_active_dims": -1}}, "--max-active-dims must be at least 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            run(small_config(src, tmp_path / "o.jsonl", path, **over), progress=Progress("off"))
    assert not (tmp_path / "o.jsonl").exists()


def test_max_active_dims_keeps_each_rows_largest_entries(tmp_path, one_torch_thread):
    path = build_splade(tmp_path / "m", seed=5)
    texts = make_texts(40, seed=2)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    _, table = run_job(small_config(src, tmp_path / "out.parquet", path, sparse={"max_active_dims": 7}))
    theirs = sparse_encoder_vectors(path, texts)
    ours = dense(table, theirs.shape[1])
    assert [len(i) for i in table.column("indices").to_pylist()] == [7] * len(texts)
    for mine, full in zip(ours, theirs, strict=True):
        assert set(np.flatnonzero(mine)) == set(np.argsort(-full)[:7])
        assert np.abs(mine[mine != 0] - full[mine != 0]).max() <= 1e-5


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, one_torch_thread):
    path = build_splade(tmp_path / "m", seed=2)
    texts = make_texts(90, seed=5)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    assert_a_late_fault_resumes_to_the_whole_run(tmp_path, src, path, plan={"sort_window": 30})
