"""--backend transformers: the pooling tasks on transformers' own models inside hpcinfer's
pipeline, equal to the native path where both run, and the way to run what the native path
does not (an ELECTRA encoder here, checked against sentence-transformers)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcinfer.errors import ConfigError, ModelError
from tests.fixtures.tiny import build_tiny_bert, write_sentence_transformers_files
from tests.fixtures.tiny_classifier import build_tiny_classifier
from tests.fixtures.tiny_decoder import add_sentence_transformers_files, build_tiny_decoder

from ..conftest import make_texts, run_job, small_config, write_jsonl

TEXTS = make_texts(40, seed=31)


def _run(tmp_path, model, name: str, **over) -> object:
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    _, table = run_job(small_config(src, tmp_path / f"{name}.parquet", model, **over))
    return table


def _vectors(table) -> np.ndarray:  # noqa: ANN001
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)


def test_bert_and_llama_embeddings_equal_the_native_path(tmp_path, one_torch_thread):
    bert = build_tiny_bert(tmp_path / "bert", seed=3)
    native, hf = (_vectors(_run(tmp_path, bert, f"b-{b}", backend=b)) for b in ("native", "transformers"))
    assert np.abs(native - hf).max() <= 1e-5
    llama = add_sentence_transformers_files(build_tiny_decoder(tmp_path / "llama", "LlamaForCausalLM", seed=3))
    native, hf = (_vectors(_run(tmp_path, llama, f"l-{b}", backend=b)) for b in ("native", "transformers"))
    assert np.abs(native - hf).max() <= 1e-5


def test_classify_equals_the_native_path(tmp_path, one_torch_thread):
    model = build_tiny_classifier(tmp_path / "m", "roberta", seed=2)
    tables = [_run(tmp_path, model, b, task="classify", backend=b, classify={"all_scores": True})
              for b in ("native", "transformers")]  # fmt: skip
    native, hf = (np.asarray(t.column("scores").to_pylist()) for t in tables)
    assert np.abs(native - hf).max() <= 1e-5
    assert tables[0].column("label").to_pylist() == tables[1].column("label").to_pylist()


def test_an_architecture_only_transformers_runs(tmp_path, one_torch_thread):
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    path = tmp_path / "electra"
    source = build_tiny_bert(tmp_path / "src")  # its tokenizer files
    torch.manual_seed(0)
    config = transformers.ElectraConfig(vocab_size=30522, embedding_size=32, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64)  # fmt: skip
    transformers.ElectraModel(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            (path / name).write_bytes((source / name).read_bytes())
    write_sentence_transformers_files(path, 32, "mean", True, 128)
    with pytest.raises(ModelError, match="--backend transformers"):
        _run(tmp_path, path, "native", backend="native")
    ours = _vectors(_run(tmp_path, path, "hf", backend="transformers"))
    theirs = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert np.abs(ours - theirs).max() <= 1e-5
    assert np.array_equal(_vectors(_run(tmp_path, path, "auto")), ours)  # no flag: the same fallback


def test_generation_refuses_what_static_batches_lack(tmp_path):
    """Generation runs on the backend (tests/unit/test_hf_generate.py); an option it cannot honour is refused."""
    model = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=1)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    cfg = small_config(src, tmp_path / "o.jsonl", model, backend="transformers", device={"cuda_graphs": True})
    with pytest.raises(ConfigError, match="--cuda-graphs needs hpcinfer's own engine.*static batches"):
        run_job(cfg)
