"""Checkpoints of every sentence-transformers layout, read as sentence-transformers reads them.

The installed sentence-transformers (6.x) saves the tiny checkpoints here itself: its
sentence_bert_config.json has no `max_seq_length` (the limit is the tokenizer's
`model_max_length` in tokenizer_config.json), its Pooling config names one `pooling_mode` string,
and modules.json names the modules by their new paths. hpcinfer's embeddings of rows longer than
the checkpoint's max_seq_length must equal `SentenceTransformer.encode`'s, and what hpcinfer reads
(max_seq_length, pooling, normalisation) must be what sentence-transformers reads from the same
files, for the 2.x-5.x spellings too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers import Tokenizer

from hpcinfer.errors import ModelError
from hpcinfer.models.registry import inspect_embedder
from hpcinfer.models.st_files import pooling_mode
from tests.fixtures.tiny import build_tiny_bert, write_sentence_transformers_files
from tests.fixtures.tiny_decoder import CHAT_TEMPLATE, build_tiny_decoder

from ..conftest import make_texts, run_job, small_config, write_jsonl

MAX_SEQ = 32  # far below the rows' lengths (make_texts: up to 80 words) and the 512 positions
TEXTS = make_texts(40, seed=9)
# hpcinfer's name of each sentence-transformers pooling mode
MODES = {"cls": "cls", "mean": "mean", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len", "lasttoken": "last"}


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Hugging Face checkpoints the tests wrap as sentence-transformers models."""
    root = tmp_path_factory.mktemp("raw")
    qwen3 = build_tiny_decoder(root / "qwen3", "Qwen3ForCausalLM", head_dim=24, seed=5)
    # NOTE: without a chat template: with one, 6.x embeds every text as a chat message (a test below)
    tokenizer_config = json.loads((qwen3 / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (qwen3 / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return {"bert": build_tiny_bert(root / "bert"), "qwen3": qwen3}


def save_st(raw_model: Path, out: Path, mode: str | tuple[str, ...], *, normalize: bool = True, **pool) -> Path:
    """`raw_model` as a SentenceTransformer (Transformer, Pooling, Normalize) saved by the installed library."""
    transformer = Transformer(str(raw_model), max_seq_length=MAX_SEQ)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=mode, **pool)]
    SentenceTransformer(modules=modules + [Normalize()] * normalize, device="cpu").save(str(out))
    return out


def long_rows(model: Path, texts: list[str]) -> list[int]:
    """The rows that tokenize to more than MAX_SEQ tokens, special tokens included."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return [i for i, t in enumerate(texts) if len(tokenizer.encode(t).ids) > MAX_SEQ]


def ours(tmp_path: Path, model: Path, texts: list[str]) -> np.ndarray:
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    _, table = run_job(small_config(src, tmp_path / "out.parquet", model))
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)


def assert_equal_to_sentence_transformers(tmp_path: Path, model: Path, texts: list[str] = TEXTS) -> None:
    oracle = SentenceTransformer(str(model), device="cpu")
    assert inspect_embedder(model).max_seq_length == oracle.max_seq_length == MAX_SEQ
    rows = long_rows(model, texts)
    assert len(rows) >= 8  # the rows the limit truncates are what this compares
    theirs = oracle.encode(texts, batch_size=16, convert_to_numpy=True)
    mine = ours(tmp_path, model, texts)
    assert mine.shape == theirs.shape
    a, b = mine[rows], theirs[rows]
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() >= 0.9999, f"min cosine {cos.min():.6f} on rows longer than {MAX_SEQ} tokens"
    # NOTE: float32 both sides; only the order of the sums differs
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-4 * max(1.0, float(np.abs(theirs).max())))


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "mean_sqrt_len_tokens"])
def test_a_bert_embedder_saved_by_sentence_transformers(tmp_path, raw, mode):
    model = save_st(raw["bert"], tmp_path / "st", mode, normalize=mode == "mean")
    assert "max_seq_length" not in json.loads((model / "sentence_bert_config.json").read_text())  # the 6.x layout
    assert inspect_embedder(model).pooling.mode == MODES[mode]
    assert_equal_to_sentence_transformers(tmp_path, model)


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_a_decoder_embedder_saved_by_sentence_transformers(tmp_path, raw, mode, one_torch_thread):
    model = save_st(raw["qwen3"], tmp_path / "st", mode)
    assert set(json.loads((model / "sentence_bert_config.json").read_text())["modality_config"]) == {"text"}
    info = inspect_embedder(model)
    assert info.decoder is not None and info.pooling.mode == MODES[mode] and info.pooling.normalize
    assert_equal_to_sentence_transformers(tmp_path, model)


def test_what_hpcinfer_cannot_do_is_a_clear_error(tmp_path, raw):
    """Modules and settings of a checkpoint saved by the installed library that hpcinfer does not
    compute: refused at start-up in one line, never embedded without them. (With a chat template,
    6.x renders each text as a chat message, and truncates its content, not the template's suffix.)"""
    cases = {
        "weightedmean": save_st(raw["bert"], tmp_path / "weighted", "weightedmean"),
        "'mean', 'max'": save_st(raw["bert"], tmp_path / "two", ("mean", "max")),
        "include_prompt": save_st(raw["bert"], tmp_path / "no_prompt", "mean", include_prompt=False),
    }
    chat = shutil.copytree(raw["qwen3"], tmp_path / "chat_raw")
    tokenizer_config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": CHAT_TEMPLATE}))
    cases["chat messages"] = save_st(chat, tmp_path / "chat", "lasttoken")
    assert SentenceTransformer(str(cases["chat messages"]), device="cpu").preprocess(["a row"])["modality"] == "message"
    dense = tmp_path / "dense"
    transformer = Transformer(str(raw["bert"]), max_seq_length=MAX_SEQ)
    SentenceTransformer(modules=[transformer, Pooling(32), Dense(32, 16)], device="cpu").save(str(dense))
    cases["Dense"] = dense
    for needle, model in cases.items():
        with pytest.raises(ModelError, match=needle) as err:
            inspect_embedder(model)
        assert "\n" not in str(err.value)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "a row"}])
    with pytest.raises(ModelError, match="Dense"):
        run_job(small_config(src, tmp_path / "out.parquet", dense))


# The 2.x-5.x layout: the installed library no longer writes these files (no `max_seq_length`
# key, no `pooling_mode_*` flags), so the tests below write them, with tests/fixtures/tiny.py; the
# installed library still reads them, and is the oracle for what they mean.


def old_layout(tmp_path: Path, raw_bert: Path, pooling: str, max_seq_length: int | None = MAX_SEQ) -> Path:
    path = tmp_path / f"old_{pooling}"
    shutil.copytree(raw_bert, path, dirs_exist_ok=True)
    write_sentence_transformers_files(path, 32, pooling, True, max_seq_length or 0)
    if max_seq_length is None:
        (path / "sentence_bert_config.json").write_text('{"max_seq_length": null, "do_lower_case": false}')
    return path


FLAGS = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "mean_sqrt_len": "mean_sqrt_len_tokens",
         "last": "lasttoken"}  # fmt: skip


@pytest.mark.parametrize("pooling", sorted(FLAGS))
def test_the_pre_6_pooling_flags_read_as_sentence_transformers_reads_them(tmp_path, raw, pooling):
    path = old_layout(tmp_path, raw["bert"], pooling)
    flags = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert "pooling_mode" not in flags
    assert [key for key, on in flags.items() if on is True] == [f"pooling_mode_{FLAGS[pooling]}"]
    modules = json.loads((path / "modules.json").read_text())
    assert modules[1]["type"] == "sentence_transformers.models.Pooling"
    oracle = SentenceTransformer(str(path), device="cpu")
    info = inspect_embedder(path)
    assert info.pooling.mode == MODES[oracle[1].pooling_mode] == pooling
    assert info.pooling.normalize and isinstance(oracle[2], Normalize)
    assert info.max_seq_length == oracle.max_seq_length == MAX_SEQ


@pytest.mark.parametrize(
    "flags",
    [{}, {"cls_token": True, "mean_tokens": True}, {"weightedmean_tokens": True}, {"max_tokens": True}],
    ids=["none", "two", "weightedmean", "max"],
)
def test_pre_6_flag_sets_read_as_sentence_transformers_reads_them(tmp_path, flags):
    """Flags set to none (6.x reads mean), to several (concatenated), to a mode hpcinfer does not
    compute: hpcinfer's reading, or its error, against the installed Pooling module's."""
    every = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    cfg = {"word_embedding_dimension": 32, **{f"pooling_mode_{k}": flags.get(k, False) for k in every}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = Pooling.load(str(tmp_path)).pooling_mode
    if isinstance(theirs, str) and theirs in MODES:
        assert pooling_mode(cfg, tmp_path) == MODES[theirs]
    else:
        with pytest.raises(ModelError, match="weightedmean" if theirs == "weightedmean" else "several modes"):
            pooling_mode(cfg, tmp_path)


def test_max_seq_length_comes_from_where_each_layout_keeps_it(tmp_path, raw):
    """Each case's limit as hpcinfer and sentence-transformers read it (the copied MiniLM
    tokenizer_config.json says 512, as many positions as the model has)."""
    cases = {"max_seq_length": old_layout(tmp_path, raw["bert"], "mean")}  # the old key, over the tokenizer's
    tokenizer_config = json.loads((cases["max_seq_length"] / "tokenizer_config.json").read_text())
    for name, limit in (("tokenizer", 48), ("sentinel", int(1e30))):  # 1e30: transformers' "unset"
        path = cases[name] = old_layout(tmp_path / name, raw["bert"], "mean", max_seq_length=None)
        (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": limit}))
    # a limit the config passes its tokenizer (`tokenizer_args`, 6.x `processor_kwargs`) wins over the key
    path = cases["tokenizer_args"] = old_layout(tmp_path / "args", raw["bert"], "mean")
    st_cfg = {"max_seq_length": MAX_SEQ, "do_lower_case": False, "tokenizer_args": {"model_max_length": 24}}
    (path / "sentence_bert_config.json").write_text(json.dumps(st_cfg))
    found = {
        name: (inspect_embedder(p).max_seq_length, SentenceTransformer(str(p), device="cpu").max_seq_length)
        for name, p in cases.items()
    }
    expected = {"max_seq_length": MAX_SEQ, "tokenizer": 48, "sentinel": 512, "tokenizer_args": 24}
    assert found == {name: (n, n) for name, n in expected.items()}


def test_a_6x_text_max_length_truncates_as_sentence_transformers(tmp_path, raw):
    """6.x `processing_kwargs`: a text `max_length` the tokenizer is called with, over its model_max_length."""
    transformer = Transformer(str(raw["bert"]), max_seq_length=MAX_SEQ, processing_kwargs={"text": {"max_length": 20}})
    path = tmp_path / "text_max"
    SentenceTransformer(modules=[transformer, Pooling(32)], device="cpu").save(str(path))
    oracle = SentenceTransformer(str(path), device="cpu")
    width = oracle.preprocess([TEXTS[i] for i in long_rows(path, TEXTS)])["input_ids"].shape[1]
    assert inspect_embedder(path).max_seq_length == width == 20


def test_an_old_layout_decoder_embeds_long_rows_as_sentence_transformers(tmp_path, raw, one_torch_thread):
    path = tmp_path / "old_qwen3"
    shutil.copytree(raw["qwen3"], path)
    write_sentence_transformers_files(path, 64, "last", True, MAX_SEQ)
    assert_equal_to_sentence_transformers(tmp_path, path)


def test_do_lower_case_lowercases_as_sentence_transformers(tmp_path, raw):
    """The 2.x-5.x `do_lower_case: true` over a cased tokenizer: the texts are lowercased first."""
    path = old_layout(tmp_path, raw["bert"], "mean")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False  # a cased tokenizer: "The" and "the" differ
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ, "do_lower_case": True}))
    texts = [t.title() if i % 2 else t.upper() for i, t in enumerate(TEXTS)]
    assert_equal_to_sentence_transformers(tmp_path, path, texts)
