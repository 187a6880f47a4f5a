"""--pooling, --normalize, --dimensions, --prompt and --prompt-name against sentence-transformers.

Each case embeds with options over a checkpoint whose files say otherwise (mean pooling,
normalised); the oracle is sentence-transformers loading a checkpoint with the same weights whose
files say what the options say, encoding with the same prompt and `truncate_dim`.
"""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from hpcinfer.cli.options import build_run_config, declared
from hpcinfer.errors import ConfigError
from tests.fixtures.tiny import build_tiny_bert

from ..conftest import make_texts, run_job, small_config, write_jsonl, write_parquet

TEXTS = make_texts(40, seed=6)
PROMPTS = {"query": "query: ", "doc": "passage: "}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Mean pooling, normalised, a default prompt: what every case overrides."""
    path = tmp_path_factory.mktemp("opts") / "m"
    return build_tiny_bert(path, hidden=32, seed=4, prompts=PROMPTS, default_prompt_name="query")


def oracle(tmp_path, pooling: str, prompt: str | None, dims: int | None, normalize: bool) -> np.ndarray:
    path = build_tiny_bert(tmp_path / f"st-{pooling}", hidden=32, seed=4, pooling=pooling, normalize=False)
    st = SentenceTransformer(str(path), device="cpu")
    return st.encode(TEXTS, prompt=prompt, truncate_dim=dims, normalize_embeddings=normalize, convert_to_numpy=True)


def sections(options: dict) -> dict:
    """--prompt and --prompt-name are the tokenizer's (every pooling task's), the rest the embed task's."""
    tokenize = {k: options.pop(k) for k in ("prompt", "prompt_name") if k in options}
    return {"embed": options, "tokenize": tokenize}


def embed(tmp_path, model, **options) -> np.ndarray:
    tmp_path.mkdir(exist_ok=True)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    _, table = run_job(small_config(src, tmp_path / "out.parquet", model, **sections(options)))
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)


@pytest.mark.parametrize(
    ("pooling", "normalize", "dims", "prompt"),
    [
        ("cls", True, None, "find: "),
        ("max", False, 16, "query: "),
        ("mean_sqrt_len", True, 8, ""),
        ("last", True, None, "passage: "),
        ("mean", False, 24, "x "),
    ],
)
def test_options_equal_sentence_transformers(tmp_path, model, pooling, normalize, dims, prompt):
    ours = embed(tmp_path, model, pooling=pooling, normalize=normalize, dimensions=dims, prompt=prompt)
    theirs = oracle(tmp_path, pooling, prompt, dims, normalize)
    assert ours.shape == theirs.shape == (len(TEXTS), dims or 32)
    assert np.abs(ours - theirs).max() <= 1e-5


def test_the_checkpoints_default_prompt_and_a_named_one(tmp_path, model):
    st = SentenceTransformer(str(model), device="cpu")
    default = st.encode(TEXTS, convert_to_numpy=True)  # applies default_prompt_name, as hpcinfer does
    assert np.abs(embed(tmp_path / "a", model) - default).max() <= 1e-5
    named = st.encode(TEXTS, prompt_name="doc", convert_to_numpy=True)
    assert np.abs(embed(tmp_path / "b", model, prompt_name="doc") - named).max() <= 1e-5
    assert np.abs(default - named).max() > 1e-3  # the prompt matters


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dimensions": 33}, "--dimensions 33: the model's embeddings have 32 dimensions"),
        ({"dimensions": 0}, "--dimensions must be at least 1"),
        ({"prompt_name": "nope"}, "--prompt-name 'nope': the checkpoint's prompts are doc, query"),
        ({"prompt": "a", "prompt_name": "doc"}, "give --prompt or --prompt-name, not both"),
    ],
)
def test_bad_options_are_clear_errors(tmp_path, model, options, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "hi"}])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        run_job(small_config(src, tmp_path / "out.parquet", model, **sections(dict(options))))


def test_normalize_and_no_normalize_share_one_field():
    def parse(*flags: str):
        values = {o.name: None for o in declared("run")}
        values.update({o.name: False for o in declared("run") if o.switch})
        values.update(inputs=("x.jsonl",), **{f.lstrip("-").replace("-", "_"): True for f in flags})
        return build_run_config(values, "run").embed.normalize

    assert (parse(), parse("--normalize"), parse("--no-normalize")) == (None, True, False)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_prompt_column_gives_each_row_its_own_prompt(tmp_path, model, fmt):
    rows = [{"id": i, "text": t} for i, t in enumerate(TEXTS)]
    for i, row in enumerate(rows):
        row["instruction"] = ["query: ", "passage: ", None][i % 3]  # null: the run's prompt
    if fmt == "parquet":
        src = write_parquet(tmp_path / "in.parquet", rows, row_group_size=16)
    else:
        rows[5]["instruction"] = 7  # not text: that row is a reject, the others go on
        src = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = small_config(
        src, tmp_path / "out.parquet", model, input={"prompt_column": "instruction"}, tokenize={"prompt": "x: "}
    )
    report, table = run_job(cfg)
    st = SentenceTransformer(str(model), device="cpu")
    kept = [i for i in range(len(TEXTS)) if not (fmt == "jsonl" and i == 5)]
    expected = [st.encode([TEXTS[i]], prompt=rows[i]["instruction"] or "x: ", convert_to_numpy=True)[0] for i in kept]
    ours = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    assert table.column("id").to_pylist() == kept
    assert np.abs(ours - np.asarray(expected)).max() <= 1e-5
    assert report.rejects == ({"invalid_prompt": 1} if fmt == "jsonl" else {})
