"""Every native encoder architecture beyond BERT embeds as sentence-transformers does, with no
backend flag: DistilBERT, MPNet, ModernBERT (global and sliding-window layers, rows packed without
padding) and NomicBERT (rotary, SwiGLU).

A tiny random checkpoint of each, built by the installed transformers' own class and wrapped by
sentence-transformers, embeds 300 rows (some past the checkpoint's limit) through `hpcinfer run`'s
job; `SentenceTransformer.encode` is the oracle, and the report says the run was native.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers import Tokenizer

from hpcinfer.models.registry import inspect_embedder, resolve_model_path

from ..conftest import make_texts, run_job, small_config, write_jsonl

TEXTS = make_texts(300, seed=47)
SHAPE = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 96}
# model_type -> (transformers' class prefix, config fields, the positions the checkpoint leaves rows)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], int]] = {
    "distilbert": (
        "DistilBert",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 96, "max_position_embeddings": 64, "pad_token_id": 0},
        64,
    ),
    "mpnet": ("MPNet", {**SHAPE, "max_position_embeddings": 66, "pad_token_id": 1}, 64),
    "modernbert": (
        "ModernBert",
        # NOTE: a window of 8 tokens either side, so most rows' local layers see only part of them
        {
            **SHAPE,
            "max_position_embeddings": 64,
            "local_attention": 16,
            "pad_token_id": 0,
            "bos_token_id": 101,
            "eos_token_id": 102,
            "cls_token_id": 101,
            "sep_token_id": 102,
        },
        64,
    ),  # fmt: skip
    "nomic_bert": ("NomicBert", {**SHAPE, "max_position_embeddings": 64, "pad_token_id": 0}, 64),
}


def build(root: Path, kind: str, pooling: str = "mean") -> Path:
    """A random `kind` model (transformers' own class) as a saved SentenceTransformer."""
    import torch

    prefix, fields, limit = ARCHITECTURES[kind]
    raw = root / f"{kind}-raw"
    raw.mkdir(parents=True)
    source = resolve_model_path("default")
    shutil.copy(source / "tokenizer.json", raw / "tokenizer.json")
    vocab = len(json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    config = getattr(transformers, f"{prefix}Config")(vocab_size=vocab, **fields)
    torch.manual_seed(5)
    model = getattr(transformers, f"{prefix}Model")(config).eval()
    with torch.no_grad():  # NOTE: weights large enough that attention is sharp (a wrong mask or position
        for name, p in model.named_parameters():  # shows), and norms and biases not at their 1 and 0
            if p.dim() == 1:
                p.copy_(
                    (1.0 if "norm" in name.lower() and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p)
                )
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(raw, safe_serialization=True)
    (raw / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "model_max_length": 512})
    )
    transformer = Transformer(str(raw), max_seq_length=limit)
    out = root / kind
    modules = [transformer, Pooling(64, pooling_mode=pooling)]
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def cosines(ours: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_embeddings_equal_sentence_transformers_natively_with_no_backend_flag(tmp_path, kind):
    model = build(tmp_path, kind)
    info = inspect_embedder(model, "embed")
    assert info.config.model_type == kind
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.no_truncation()
    assert sum(len(tokenizer.encode(t).ids) > info.max_seq_length for t in TEXTS) >= 10, "rows past the limit"
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    report, table = run_job(small_config(src, tmp_path / "out.parquet", model))
    ours = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    oracle = SentenceTransformer(str(model), device="cpu")
    assert oracle.max_seq_length == info.max_seq_length
    expected = oracle.encode(TEXTS, batch_size=32, convert_to_numpy=True)
    cos = cosines(ours, expected)
    assert cos.min() >= 0.99999, f"min cosine {cos.min():.7f} at row {int(cos.argmin())}"
    assert report.rows == len(TEXTS)
