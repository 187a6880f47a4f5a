"""RoBERTa, XLM-R and CamemBERT embedding checkpoints run on the native encoder with no backend flag.

Each is BERT's shape with positions counted from `padding_idx + 1` and one token type. A tiny random
checkpoint of each, saved by the installed transformers and wrapped by sentence-transformers, is
embedded by hpcinfer (rows past the checkpoint's limit included) and by `SentenceTransformer.encode`,
the oracle.
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
from tokenizers import Tokenizer

from hpcinfer.models.registry import inspect_embedder, resolve_model_path

from ..conftest import make_texts, run_job, small_config, write_jsonl

POSITIONS = 66  # 64 tokens fit after the padding offset of 2: the rows below run past it
TEXTS = make_texts(300, seed=21)
FAMILIES = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"}


def build(root: Path, family: str) -> Path:
    """A random `family` model (transformers' own class) as a saved SentenceTransformer."""
    import torch

    raw = root / f"{family}-raw"
    raw.mkdir(parents=True)
    source = resolve_model_path("default")
    shutil.copy(source / "tokenizer.json", raw / "tokenizer.json")
    vocab = len(json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    prefix = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=POSITIONS, pad_token_id=1, type_vocab_size=1,
    )  # fmt: skip
    torch.manual_seed(3)
    getattr(transformers, f"{prefix}Model")(config).eval().save_pretrained(raw, safe_serialization=True)
    (raw / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "model_max_length": 512})
    )
    transformer = Transformer(str(raw), max_seq_length=POSITIONS - 2)  # as XLM-R checkpoints: 512 of 514
    out = root / family
    SentenceTransformer(modules=[transformer, Pooling(64, pooling_mode="mean")], device="cpu").save(str(out))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_equal_sentence_transformers_with_no_backend_flag(tmp_path, family):
    model = build(tmp_path, family)
    info = inspect_embedder(model, "embed")
    assert info.max_seq_length == POSITIONS - 2  # the positions left after padding_idx + 1
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.no_truncation()
    assert sum(len(tokenizer.encode(t).ids) > info.max_seq_length for t in TEXTS) >= 5, "rows past the limit"
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    report, table = run_job(small_config(src, tmp_path / "out.parquet", model))
    ours = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    oracle = SentenceTransformer(str(model), device="cpu")
    assert oracle.max_seq_length == info.max_seq_length
    expected = oracle.encode(TEXTS, batch_size=16, convert_to_numpy=True)
    cos = (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))
    assert cos.min() >= 0.99999, f"min cosine {cos.min():.7f} at row {int(cos.argmin())}"
    assert report.rows == len(TEXTS)
