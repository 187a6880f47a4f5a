"""Every native encoder architecture beyond BERT embeds as sentence-transformers does, with no
backend flag: RoBERTa, XLM-R and CamemBERT (positions from padding_idx + 1), DistilBERT, MPNet
(relative position bias), ModernBERT (global and sliding-window layers, rows packed without
padding) and NomicBERT (rotary, SwiGLU).

A tiny random checkpoint of each, built by the installed transformers' own class and wrapped by
sentence-transformers, embeds 300 rows (some past the checkpoint's limit) through `hpcinfer run`'s
job; `SentenceTransformer.encode` is the oracle, and the report says the run was native.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer

from hpcinfer.models.registry import inspect_embedder
from tests.fixtures.tiny_encoders import ARCHITECTURES, build_tiny_encoder

from ..conftest import assert_a_late_fault_resumes_to_the_whole_run, make_texts, run_job, small_config, write_jsonl

TEXTS = make_texts(300, seed=47)


def cosines(ours: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_embeddings_equal_sentence_transformers_natively_with_no_backend_flag(tmp_path, kind):
    model = build_tiny_encoder(tmp_path, kind)
    info = inspect_embedder(model, "embed")
    assert info.config.model_type == kind
    assert info.max_seq_length == 64  # RoBERTa's: the positions left after padding_idx + 1 (66 - 2)
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
    assert report.rows == len(TEXTS) and report.backend == "native"


def test_modernbert_rows_packed_without_padding_equal_sentence_transformers(tmp_path, monkeypatch):
    """Every padded batch packed (the default packs only batches mostly padding): the same embeddings."""
    from hpcinfer.models import modernbert

    monkeypatch.setattr(modernbert, "UNPAD_BELOW", 2.0)
    packed = []
    monkeypatch.setattr(modernbert.Rows, "packed", _counting(modernbert.Rows.packed, packed))
    model = build_tiny_encoder(tmp_path, "modernbert")
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    _, table = run_job(small_config(src, tmp_path / "out.parquet", model))
    ours = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    expected = SentenceTransformer(str(model), device="cpu").encode(TEXTS, batch_size=32, convert_to_numpy=True)
    assert cosines(ours, expected).min() >= 0.99999
    assert any(packed), "no batch was packed"


def _counting(method, seen: list):  # noqa: ANN001, ANN202
    def packed(self, x):  # noqa: ANN001, ANN202
        seen.append(self.index is not None)
        return method(self, x)

    return packed


@pytest.mark.parametrize("kind", ["modernbert", "nomic_bert"])
def test_token_embeddings_equal_sentence_transformers(tmp_path, kind):
    model = build_tiny_encoder(tmp_path, kind)
    texts = TEXTS[:60]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    _, table = run_job(small_config(src, tmp_path / "out.parquet", model, embed={"output_value": "token_embeddings"}))
    ours = [np.asarray(row, np.float32) for row in table.column("token_embeddings").to_pylist()]
    st = SentenceTransformer(str(model), device="cpu")
    theirs = [t.numpy() for t in st.encode(texts, output_value="token_embeddings", batch_size=16)]
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    scale = max(float(np.abs(t).max()) for t in theirs)
    assert max(float(np.abs(o - t).max()) for o, t in zip(ours, theirs, strict=True)) <= 1e-5 * scale


def test_rejects_and_a_late_fault_resume_to_the_whole_run_on_modernbert(tmp_path):
    """The pipeline around the model is the same for every architecture: bad rows are rejects, and
    a run failing in its last window resumes to exactly the uninterrupted output (rows packed
    without padding included)."""
    model = build_tiny_encoder(tmp_path, "modernbert")
    rows: list[dict] = [{"id": i, "text": t} for i, t in enumerate(TEXTS[:150])]
    rows[7]["text"], rows[90]["text"] = "", 12
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert_a_late_fault_resumes_to_the_whole_run(tmp_path, src, model)
    rejects = (tmp_path / "part.jsonl.rejects.jsonl").read_text().splitlines()
    assert [json.loads(r)["row"] for r in rejects] == [7, 90]


@pytest.mark.parametrize("kind", ["mpnet", "modernbert", "nomic_bert"])
def test_int8_weights_take_every_native_encoder(tmp_path, kind):
    """--quantize int8 swaps the linears of any native encoder's `layers`; the run's own check (int8
    against float32 on its first rows) passes and the output is not the float one."""
    model = build_tiny_encoder(tmp_path, kind)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:80])])
    _, floats = run_job(small_config(src, tmp_path / "f32.parquet", model))
    report, ints = run_job(small_config(src, tmp_path / "i8.parquet", model, device={"quantize": "int8"}))
    assert report.quantize["chosen"] == "int8", report.quantize
    ours = np.asarray(ints.column("embedding").to_pylist(), dtype=np.float32)
    ref = np.asarray(floats.column("embedding").to_pylist(), dtype=np.float32)
    assert not np.array_equal(ours, ref) and cosines(ours, ref).min() >= 0.98


def _as_hub_checkpoint(model: Path, kind: str) -> None:
    """Rewrites a checkpoint saved by transformers 5 in the form its hub releases have: NomicBERT's
    own tensor and config names (`attn.Wqkv`, `mlp.fc11` / `fc12`, `norm1`, `emb_ln`, `n_embd`, ...),
    ModernBERT's older config (`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`)."""
    import torch
    from safetensors.torch import load_file, save_file

    raw = model / "config.json"
    config = json.loads(raw.read_text())
    if kind == "modernbert":
        rope = config.pop("rope_parameters")
        config.pop("layer_types")
        config |= {"global_attn_every_n_layers": 3, "global_rope_theta": rope["full_attention"]["rope_theta"],
                   "local_rope_theta": rope["sliding_attention"]["rope_theta"]}  # fmt: skip
        raw.write_text(json.dumps(config))
        return
    names = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
             "intermediate_size": "n_inner", "max_position_embeddings": "n_positions",
             "layer_norm_eps": "layer_norm_epsilon"}  # fmt: skip
    config = {names.get(k, k): v for k, v in config.items() if k not in ("hidden_act", "rope_parameters")}
    config |= {"activation_function": "swiglu", "rotary_emb_base": 1000.0, "rotary_emb_fraction": 1.0,
               "qkv_proj_bias": False, "prenorm": False}  # fmt: skip
    raw.write_text(json.dumps(config))
    weights = load_file(str(model / "model.safetensors"))
    hub: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if name.endswith("self_attn.q_proj.weight"):
            parts = [weights[f"layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
            hub[f"encoder.layers.{layer}.attn.Wqkv.weight"] = torch.cat(parts)
        elif "self_attn.k_proj" in name or "self_attn.v_proj" in name:
            continue
        else:
            for old, new in (("layers.", "encoder.layers."), ("self_attn.o_proj", "attn.out_proj"),
                             ("mlp.up_proj", "mlp.fc11"), ("mlp.gate_proj", "mlp.fc12"), ("mlp.down_proj", "mlp.fc2"),
                             ("post_attention_layernorm", "norm1"), ("post_mlp_layernorm", "norm2"),
                             ("embeddings.LayerNorm", "emb_ln")):  # fmt: skip
                name = name.replace(old, new) if not (old == "layers." and name.startswith("encoder.")) else name
            hub[name] = tensor.contiguous()
    save_file(hub, str(model / "model.safetensors"))


@pytest.mark.parametrize("kind", ["nomic_bert", "modernbert"])
def test_a_checkpoint_in_its_hub_release_form_embeds_the_same(tmp_path, kind):
    """nomic-embed-text's tensors and config keep the names of its own code; ModernBERT's hub configs
    predate `layer_types`: the native path reads both as transformers 5's form."""
    model = build_tiny_encoder(tmp_path, kind)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:60])])
    _, ours = run_job(small_config(src, tmp_path / "out.parquet", model))
    _as_hub_checkpoint(model, kind)
    config = json.loads((model / "config.json").read_text())
    if kind == "nomic_bert":
        from safetensors import safe_open

        with safe_open(str(model / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert {"encoder.layers.0.attn.Wqkv.weight", "encoder.layers.0.mlp.fc12.weight", "emb_ln.weight"} <= names
        assert "n_embd" in config and "hidden_size" not in config
    else:
        assert "layer_types" not in config and "global_rope_theta" in config
    _, again = run_job(small_config(src, tmp_path / "hub.parquet", model))
    a = np.asarray(ours.column("embedding").to_pylist(), dtype=np.float32)
    b = np.asarray(again.column("embedding").to_pylist(), dtype=np.float32)
    assert np.array_equal(a, b)


def test_mpnet_buckets_distances_into_32_whatever_its_table_holds(tmp_path):
    """transformers' MPNet buckets with its default 32 whatever `relative_attention_num_buckets` sizes
    the table to: a 64-entry table embeds as sentence-transformers does too."""
    fields = {**ARCHITECTURES["mpnet"][1], "relative_attention_num_buckets": 64}
    model = build_tiny_encoder(tmp_path, "mpnet", fields=fields)
    texts = TEXTS[:60]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    _, table = run_job(small_config(src, tmp_path / "out.parquet", model))
    ours = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    expected = SentenceTransformer(str(model), device="cpu").encode(texts, batch_size=16, convert_to_numpy=True)
    assert cosines(ours, expected).min() >= 0.99999


def test_what_the_native_encoders_lack_is_an_unsupported_model_in_one_line(tmp_path):
    """An activation, a sharded checkpoint or a NomicBERT token classifier (a head NomicBERT's own
    code does not ship) are refused natively as UnsupportedModel (--backend auto falls back)."""
    from hpcinfer.errors import UnsupportedModel
    from hpcinfer.models.checkpoint import inspect_checkpoint
    from hpcinfer.tasks.ner.model import inspect_token_classifier
    from tests.fixtures.tiny import build_tiny_bert

    model = build_tiny_bert(tmp_path / "bert")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_act": "quick_gelu"}))
    with pytest.raises(UnsupportedModel, match="hidden_act 'quick_gelu'"):
        inspect_checkpoint(model)
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(UnsupportedModel, match="sharded"):
        inspect_checkpoint(model)
    (model / "model-00001-of-00001.safetensors").rename(model / "model.safetensors")
    token = {**config, "model_type": "nomic_bert", "architectures": ["NomicBertForTokenClassification"]}
    (model / "config.json").write_text(json.dumps(token))
    with pytest.raises(UnsupportedModel, match="no native token classifier for 'NomicBertForTokenClassification'"):
        inspect_token_classifier(model, None)
