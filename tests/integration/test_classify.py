"""--task classify against transformers' own AutoModelForSequenceClassification on the same
checkpoint: BERT, RoBERTa (positions from padding_idx + 1), XLM-R, CamemBERT, DistilBERT, MPNet
(its relative position bias), single- and
multi-label; labels and probabilities, in input order, through the whole pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from hpcinfer.errors import ModelError
from tests.fixtures.tiny_classifier import build_tiny_classifier

from ..conftest import make_texts, run_job, small_config, write_jsonl

TEXTS = make_texts(300, seed=12)


def _oracle(path, multi_label: bool) -> np.ndarray:
    """The texts through transformers without padding, softmax or sigmoid: texts of the same token
    count in one batch (no padding needed; one forward per length, not per text)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=512)
    ids = [tokenizer.encode(text).ids for text in TEXTS]
    by_length: dict[int, list[int]] = {}
    for row, tokens in enumerate(ids):
        by_length.setdefault(len(tokens), []).append(row)
    out = np.zeros((len(TEXTS), model.config.num_labels), dtype=np.float32)
    with torch.no_grad():
        for rows in by_length.values():
            logits = model(torch.tensor([ids[r] for r in rows])).logits
            out[rows] = (torch.sigmoid(logits) if multi_label else torch.softmax(logits, -1)).numpy()
    return out


@pytest.mark.parametrize(
    ("family", "multi_label"),
    [("bert", False), ("roberta", False), ("xlm-roberta", True), ("camembert", False), ("distilbert", False),
     ("mpnet", False), ("modernbert", False), ("nomic_bert", False)],
)  # fmt: skip
def test_labels_and_scores_equal_transformers(tmp_path, family, multi_label, one_torch_thread):
    labels = ("sports", "politics", "science", "arts")
    path = build_tiny_classifier(tmp_path / family, family, labels, multi_label, seed=3)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(TEXTS)])
    cfg = small_config(src, tmp_path / "out.parquet", path, task="classify", classify={"all_scores": True})
    _, table = run_job(cfg)
    assert table.column_names == ["id", "label", "score", "scores"]
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(len(TEXTS))]
    ours = np.asarray(table.column("scores").to_pylist(), dtype=np.float32)
    theirs = _oracle(path, multi_label)
    assert np.abs(ours - theirs).max() <= 1e-5, family
    best = theirs.argmax(axis=1)
    assert table.column("label").to_pylist() == [labels[i] for i in best]
    assert np.allclose(table.column("score").to_numpy(), theirs.max(axis=1), rtol=0, atol=1e-5)
    assert np.ptp(ours, axis=0).max() > 1e-3  # the rows' probabilities really differ


def test_jsonl_output_without_all_scores_and_bad_rows(tmp_path, one_torch_thread):
    path = build_tiny_classifier(tmp_path / "m", "bert", seed=1)
    rows = [{"id": 0, "text": "fine"}, {"id": 1, "text": 7}, {"id": 2, "text": "also fine"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report, table = run_job(small_config(src, tmp_path / "out.jsonl", path, task="classify"))
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == [0, 2] and set(lines[0]) == {"id", "label", "score"}
    assert lines[0]["label"] in ("negative", "neutral", "positive") and 0 < lines[0]["score"] <= 1
    assert report.rejects == {"invalid_text": 1} or sum(report.rejects.values()) == 1


def test_an_embedding_checkpoint_is_not_a_classifier(tmp_path):
    from tests.fixtures.tiny import build_tiny_bert

    path = build_tiny_bert(tmp_path / "m")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(ModelError, match="sequence classifier"):
        run_job(small_config(src, tmp_path / "out.parquet", path, task="classify"))


def test_classify_on_two_devices_and_under_profile(tmp_path, one_torch_thread):
    """The pooling tasks run wherever embedding runs: two CPU replicas give the one-device labels,
    and `hpcinfer profile` reports a classify run."""
    import subprocess
    import sys

    path = build_tiny_classifier(tmp_path / "m", "distilbert", seed=4)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    _, one = run_job(small_config(src, tmp_path / "one.parquet", path, task="classify"))
    _, two = run_job(small_config(src, tmp_path / "two.parquet", path, task="classify", device={"devices": "cpu,cpu"}))
    assert one.column("label").to_pylist() == two.column("label").to_pylist()
    assert np.allclose(one.column("score").to_numpy(), two.column("score").to_numpy(), atol=1e-6)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "profile", str(src), "--model", str(path), "--task", "classify"],
        capture_output=True, text=True, check=False, cwd=tmp_path,  # NOTE: profile writes its trace here
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "compute" in proc.stderr + proc.stdout
