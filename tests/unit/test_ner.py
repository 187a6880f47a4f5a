"""--task ner against transformers' own `pipeline("token-classification")` on the same tiny random
checkpoints: every token's label (and its probability) in input order through the whole encoder
pipeline, resume and the task's refusals."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers

from hpcinfer.api import run
from hpcinfer.errors import ConfigError
from hpcinfer.obs.progress import Progress
from hpcinfer.registry import auto_task
from tests.fixtures.tiny_classifier import CONFIGS, build_tiny_classifier

from ..conftest import (
    assert_a_late_fault_resumes_to_the_whole_run,
    make_texts,
    run_job,
    small_config,
    write_jsonl,
)

LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")


def build_token_classifier(path, family: str = "bert", seed: int = 0):
    """A random `*ForTokenClassification` saved by transformers, with the packaged MiniLM tokenizer."""
    tokenizer_from = build_tiny_classifier(path.parent / f"{path.name}-tokenizer", family, seed=seed)
    prefix, fields = CONFIGS[family]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=transformers.AutoConfig.from_pretrained(tokenizer_from).vocab_size,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
        **fields,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForTokenClassification")(config).eval()
    with torch.no_grad():  # NOTE: a wider head than the default init, so tokens get different labels
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


def pipeline_labels(path, texts):
    """transformers' pipeline, every token kept (no label ignored, no aggregation)."""
    tagger = transformers.pipeline("token-classification", model=str(path), ignore_labels=[], device="cpu")
    found = tagger(texts, batch_size=8)
    return [[t["entity"] for t in row] for row in found], [[t["word"] for t in row] for row in found], found


@pytest.mark.parametrize("family", ["bert", "roberta", "camembert", "distilbert", "mpnet", "modernbert"])
def test_token_labels_equal_transformers_pipeline(tmp_path, family, one_torch_thread):
    path = build_token_classifier(tmp_path / family, family, seed=4)
    texts = make_texts(100, seed=21)
    texts = [" ".join(t.split()[:40]) for t in texts]  # NOTE: within the pipeline's untruncated 512 tokens
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])
    report, table = run_job(small_config(src, tmp_path / "out.parquet", path, task="ner"))
    assert table.column_names == ["id", "tokens", "labels", "scores"]
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(len(texts))]
    labels, words, found = pipeline_labels(path, texts)
    assert table.column("tokens").to_pylist() == words
    assert table.column("labels").to_pylist() == labels
    ours = np.concatenate([np.asarray(s, np.float32) for s in table.column("scores").to_pylist()])
    theirs = np.asarray([t["score"] for row in found for t in row], np.float32)
    assert np.abs(ours - theirs).max() <= 1e-4
    assert len({label for row in labels for label in row}) >= 2  # the labels really differ across tokens
    assert report.rows == len(texts)


def test_auto_picks_ner_and_options_it_ignores_are_refused(tmp_path):
    path = build_token_classifier(tmp_path / "m")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "Ada Lovelace lived in London"}])
    assert auto_task(small_config(src, tmp_path / "o.jsonl", path)) == (
        "ner",
        "a BertForTokenClassification: a label per token",
    )
    for section, values, flag in [
        ("embed", {"pooling": "mean"}, "--pooling"),
        ("generate", {"max_tokens": 5}, "--max-tokens"),
        ("input", {"pair_columns": ("a", "b")}, "--pair-columns"),
    ]:
        cfg = small_config(src, tmp_path / "o.jsonl", path, **{section: values})
        with pytest.raises(ConfigError, match=f"--task ner does not read {flag}"):
            run(cfg, progress=Progress("off"))


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, one_torch_thread):
    path = build_token_classifier(tmp_path / "m", seed=2)
    texts = make_texts(90, seed=5)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    assert_a_late_fault_resumes_to_the_whole_run(tmp_path, src, path, plan={"sort_window": 30})
