"""`--backend auto`, the default: hpcinfer's own model where it has the checkpoint's architecture,
else transformers' model inside the same pipeline, said in one line; `native` refuses what it does
not have, in one line. The report names the backend that ran.

Tiny random checkpoints of encoder architectures hpcinfer does not run natively (DeBERTa-v2,
ELECTRA), saved by the installed transformers and wrapped by sentence-transformers, embed with no
flag as `SentenceTransformer.encode` does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Pooling

from hpcinfer.api import run
from hpcinfer.errors import ConfigError, UnsupportedModel
from hpcinfer.models.registry import resolve_model_path
from hpcinfer.obs.progress import Progress

from ..conftest import make_texts, read_output, run_job, small_config, write_jsonl

TEXTS = make_texts(80, seed=48)
SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
FALLBACK = {  # model_type -> (transformers' class prefix, config fields)
    "deberta-v2": ("DebertaV2", {**SHAPE, "max_position_embeddings": 128}),
    "electra": ("Electra", {**SHAPE, "embedding_size": 32, "max_position_embeddings": 128}),
}


class Notes(Progress):
    """A silent progress that keeps the lines a run says."""

    def __init__(self) -> None:
        super().__init__("off")
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)


def build(root: Path, kind: str) -> Path:
    import torch

    prefix, fields = FALLBACK[kind]
    raw = root / f"{kind}-raw"
    raw.mkdir(parents=True)
    source = resolve_model_path("default")
    shutil.copy(source / "tokenizer.json", raw / "tokenizer.json")
    vocab = len(json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    torch.manual_seed(2)
    model = getattr(transformers, f"{prefix}Model")(
        getattr(transformers, f"{prefix}Config")(vocab_size=vocab, **fields)
    )
    model.eval().save_pretrained(raw, safe_serialization=True)
    (raw / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "model_max_length": 512})
    )
    out = root / kind
    modules = [Transformer(str(raw), max_seq_length=48), Pooling(32, pooling_mode="mean")]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


@pytest.mark.parametrize("kind", FALLBACK)
def test_an_architecture_without_a_native_model_runs_on_transformers_and_says_so(tmp_path, kind, capfd):
    model = build(tmp_path, kind)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    notes = Notes()
    capfd.readouterr()
    report = run(small_config(src, tmp_path / "out.parquet", model), progress=notes)
    assert "Loading weights" not in capfd.readouterr().err  # transformers' own progress bar stays off
    assert report.backend == "transformers"
    said = [line for line in notes.lines if "--backend transformers" in line]
    assert len(said) == 1 and f"model_type '{kind}'" in said[0] and "\n" not in said[0], notes.lines
    ours = np.asarray(read_output(str(tmp_path / "out.parquet")).column("embedding").to_pylist(), dtype=np.float32)
    expected = SentenceTransformer(str(model), device="cpu").encode(TEXTS, batch_size=16, convert_to_numpy=True)
    cos = (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))
    assert cos.min() >= 0.99999, f"min cosine {cos.min():.7f}"


def test_backend_native_refuses_an_architecture_it_does_not_have_in_one_line(tmp_path):
    model = build(tmp_path, "electra")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(UnsupportedModel, match="no native encoder for model_type 'electra'") as caught:
        run_job(small_config(src, tmp_path / "out.parquet", model, backend="native"))
    assert "\n" not in str(caught.value)


def test_a_native_architecture_runs_natively_with_nothing_said(tmp_path):
    from tests.fixtures.tiny import build_tiny_bert

    model = build_tiny_bert(tmp_path / "bert")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:10])])
    notes = Notes()
    report = run(small_config(src, tmp_path / "out.parquet", model), progress=notes)
    assert report.backend == "native" and not [line for line in notes.lines if "backend" in line]
    assert report.to_dict()["backend"] == "native"  # in the JSON report


def test_a_task_with_no_transformers_path_keeps_its_native_refusal(tmp_path):
    """NER has no transformers path: with no flag a checkpoint it cannot run is refused natively,
    and --backend transformers is refused by the task."""
    model = build(tmp_path, "electra")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(UnsupportedModel, match="no native token classifier for 'ElectraModel'"):
        run_job(small_config(src, tmp_path / "out.parquet", model, task="ner"))
    with pytest.raises(ConfigError, match="drop --backend transformers"):
        run_job(small_config(src, tmp_path / "out.parquet", model, task="ner", backend="transformers"))
