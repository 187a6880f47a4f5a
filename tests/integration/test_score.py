"""--task score (reranking) against sentence-transformers' CrossEncoder.predict on the same
checkpoint: text pairs tokenized as pairs (BERT token types from the separator), pairs longer than
the limit truncated longest side first, a sigmoid over the one logit (or the raw logit where the
checkpoint says Identity); bad pairs are rejects."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sentence_transformers import CrossEncoder
from tokenizers import Tokenizer

from hpcinfer.errors import ConfigError, ModelError
from tests.fixtures.tiny_classifier import build_tiny_classifier

from ..conftest import make_texts, run_job, small_config, write_jsonl, write_parquet

QUERIES = make_texts(12, seed=21)
DOCS = make_texts(40, seed=22)
PAIRS = [(QUERIES[i % len(QUERIES)], DOCS[i]) for i in range(len(DOCS))]


@pytest.mark.parametrize(
    ("family", "identity"),
    [
        ("bert", False),
        ("roberta", True),
        ("distilbert", False),
        ("mpnet", False),
        ("modernbert", False),
        ("nomic_bert", False),
    ],
)
def test_scores_equal_cross_encoder(tmp_path, family, identity, one_torch_thread):
    path = build_tiny_classifier(tmp_path / family, family, ("LABEL_0",), seed=5)
    if identity:  # a checkpoint whose CrossEncoder config asks for the raw logit
        config = json.loads((path / "config.json").read_text())
        config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
        (path / "config.json").write_text(json.dumps(config))
    rows = [{"id": i, "query": q, "document": d} for i, (q, d) in enumerate(PAIRS)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = small_config(src, tmp_path / "out.parquet", path, task="score", tokenize={"max_length": 48})
    _, table = run_job(cfg)
    assert table.column_names == ["id", "score"]
    ours = table.column("score").to_numpy()
    theirs = CrossEncoder(str(path), max_length=48, device="cpu").predict(PAIRS, batch_size=8)
    assert np.abs(ours - theirs).max() <= 1e-5, family
    assert np.ptp(theirs) > 1e-3 and (identity or ((theirs > 0) & (theirs < 1)).all())
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()
    assert sum(len(tokenizer.encode(q, d).ids) > 48 for q, d in PAIRS) >= 5  # pairs longer than the limit


def test_pair_columns_parquet_and_bad_pairs(tmp_path, one_torch_thread):
    path = build_tiny_classifier(tmp_path / "m", "bert", ("LABEL_0",), seed=6)
    rows = [
        {"id": "ok", "text": "a question", "text_pair": "an answer"},
        {"id": "missing", "text": "a question", "text_pair": None},
        {"id": "number", "text": "a question", "text_pair": 7},
        {"id": "empty", "text": "", "text_pair": "an answer"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)  # text + text_pair found by themselves
    report, table = run_job(small_config(src, tmp_path / "out.jsonl", path, task="score"))
    assert table.column("id").to_pylist() == ["ok"]
    rejects = {
        r["id"]: (r["reason"], r["message"])
        for r in map(json.loads, (tmp_path / "out.jsonl.rejects.jsonl").read_text().splitlines())
    }
    assert rejects["missing"] == ("missing_text", "text_pair: no text")
    assert rejects["number"][0] == "wrong_type" and rejects["number"][1].startswith("text_pair:")
    assert rejects["empty"][0] == "empty_text" and rejects["empty"][1].startswith("text:")
    # Parquet with named columns
    pq_src = write_parquet(tmp_path / "in.parquet", [{"id": i, "q": q, "d": d} for i, (q, d) in enumerate(PAIRS[:5])])
    cfg = small_config(pq_src, tmp_path / "pq.parquet", path, task="score", input={"pair_columns": ("q", "d")})
    _, table = run_job(cfg)
    theirs = CrossEncoder(str(path), device="cpu").predict(PAIRS[:5])
    assert np.abs(table.column("score").to_numpy() - theirs).max() <= 1e-5


def test_score_refusals(tmp_path):
    path = build_tiny_classifier(tmp_path / "m", "bert", seed=1)  # three labels: a classifier
    src = write_jsonl(tmp_path / "in.jsonl", [{"query": "a", "document": "b"}])
    with pytest.raises(ModelError, match="one label"):
        run_job(small_config(src, tmp_path / "out.parquet", path, task="score"))
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"text": "a"}])
    with pytest.raises(ConfigError, match="pair-columns"):
        run_job(small_config(plain, tmp_path / "out.parquet", path, task="score"))
    with pytest.raises(ConfigError, match="task score"):
        run_job(small_config(plain, tmp_path / "o.parquet", path, task="embed", input={"pair_columns": ("a", "b")}))


def test_task_auto_picks_from_the_checkpoint_and_says_why(tmp_path):
    import subprocess
    import sys

    from hpcinfer.config import RunConfig
    from hpcinfer.registry import auto_task

    scorer = build_tiny_classifier(tmp_path / "ce", "bert", ("LABEL_0",), seed=1)
    labeller = build_tiny_classifier(tmp_path / "cls", "distilbert", seed=1)
    assert auto_task(RunConfig(model=str(scorer)))[0] == "score"
    assert auto_task(RunConfig(model=str(labeller))) == (
        "classify",
        "a DistilBertForSequenceClassification with 3 labels",
    )
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "query": "a", "document": "b"}])
    proc = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(scorer),
         "--progress", "off"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "task: score (--task auto: a BertForSequenceClassification with one label: a cross-encoder)" in proc.stderr
    assert set(json.loads((tmp_path / "o.jsonl").read_text())) == {"id", "score"}
