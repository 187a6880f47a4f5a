"""Every input shape gives exactly one output row per input row, with the input's ids, in order."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from hpcinfer.models.registry import load_tokenizer

from ..conftest import make_texts, run_job, small_config, write_jsonl, write_parquet


@pytest.fixture()
def rows():
    return [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(300, seed=3))]


@pytest.fixture()
def reference(tmp_path, tiny_model, rows):
    src = write_jsonl(tmp_path / "ref.jsonl", rows)
    _, table = run_job(small_config(src, tmp_path / "ref.parquet", tiny_model))
    return table


def _embeddings(table) -> np.ndarray:
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)


def test_jsonl_keeps_ids_and_order(reference, rows):
    assert reference.column("id").to_pylist() == [r["id"] for r in rows]
    assert reference.num_rows == len(rows)
    emb = _embeddings(reference)
    assert emb.shape == (300, 32)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)  # the pooling config normalises
    assert reference.schema.field("embedding").type.list_size == 32  # fixed-size list of float32


def test_parquet_equals_jsonl(tmp_path, tiny_model, rows, reference):
    src = write_parquet(tmp_path / "in.parquet", rows)
    _, table = run_job(small_config(src, tmp_path / "out.parquet", tiny_model))
    assert table.column("id").to_pylist() == reference.column("id").to_pylist()
    assert np.array_equal(_embeddings(table), _embeddings(reference))


def test_glob_of_shards_keeps_global_order(tmp_path, tiny_model, rows, reference):
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(4):
        part = rows[k * 75 : (k + 1) * 75]
        if k % 2:
            write_parquet(shards / f"part-{k:03d}.parquet", part)
        else:
            write_jsonl(shards / f"part-{k:03d}.jsonl", part)
    _, table = run_job(small_config(tmp_path / "shards" / "part-*", tmp_path / "out.parquet", tiny_model))
    assert table.column("id").to_pylist() == [r["id"] for r in rows]
    assert np.array_equal(_embeddings(table), _embeddings(reference))
    _, from_dir = run_job(small_config(shards, tmp_path / "dir.parquet", tiny_model))
    assert from_dir.column("id").to_pylist() == [r["id"] for r in rows]


def test_pretokenized_equals_text(tmp_path, tiny_model, rows, reference):
    tok = load_tokenizer(tiny_model, 256)
    pre = [{"id": r["id"], "input_ids": tok.encode(r["text"]).ids} for r in rows]
    src = write_parquet(tmp_path / "tok.parquet", pre)
    _, table = run_job(small_config(src, tmp_path / "out.parquet", tiny_model))
    assert table.column("id").to_pylist() == [r["id"] for r in rows]
    assert np.array_equal(_embeddings(table), _embeddings(reference))


def test_openai_batch_file_is_answered_in_openai_format(tmp_path, tiny_model, rows, reference):
    """/v1/embeddings bodies: `input` a string or a one-text list, `dimensions` (cut, re-normalised),
    `encoding_format` base64; answers validate as the openai package's CreateEmbeddingResponse;
    bad requests are rejects and error lines, and the run goes on."""
    import base64

    from openai.types import CreateEmbeddingResponse

    from hpcinfer.api import run
    from hpcinfer.obs.progress import Progress

    def body(i: int, r: dict) -> dict:
        extra = [{}, {"dimensions": 8}, {"encoding_format": "base64"}, {"input": [r["text"]]}][i % 4]
        return {"model": "my-embedder", "input": r["text"], **extra}

    lines = [{"custom_id": r["id"], "method": "POST", "url": "/v1/embeddings", "body": body(i, r)}
             for i, r in enumerate(rows)]  # fmt: skip
    bad = {
        "empty": ({"model": "m", "input": []}, "empty_input"),
        "one_bad": ({"model": "m", "input": ["a", 7]}, "wrong_type"),  # one bad text rejects the request
        "wide": ({"model": "m", "input": "a", "dimensions": 10_000}, "invalid_dimensions"),
        "zero": ({"model": "m", "input": "a", "dimensions": 0}, "invalid_dimensions"),
        "number": ({"model": "m", "input": 7}, "wrong_type"),
        "format": ({"model": "m", "input": "a", "encoding_format": "hex"}, "invalid_request"),
    }
    lines += [{"custom_id": k, "method": "POST", "url": "/v1/embeddings", "body": b} for k, (b, _) in bad.items()]
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    report = run(small_config(src, tmp_path / "out.jsonl", tiny_model), progress=Progress("off"))
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]  # NOTE: not via Arrow
    assert [x["custom_id"] for x in out] == [line["custom_id"] for line in lines]  # one line per request
    expected = _embeddings(reference)
    for i, answer in enumerate(out[: len(rows)]):
        response = CreateEmbeddingResponse.model_validate(answer["response"]["body"]) if i % 4 != 2 else None
        data = answer["response"]["body"]["data"][0]["embedding"]
        vector = np.frombuffer(base64.b64decode(data), "<f4") if i % 4 == 2 else np.asarray(data, dtype=np.float32)
        want = expected[i][:8] / np.linalg.norm(expected[i][:8]) if i % 4 == 1 else expected[i]
        assert np.allclose(vector, want, atol=1e-6), i
        if response is not None:
            assert response.model == "my-embedder" and response.usage.prompt_tokens > 0
    errors = {x["custom_id"]: x["error"]["code"] for x in out[len(rows) :]}
    assert errors == {k: reason for k, (_, reason) in bad.items()}
    assert report.rows == len(rows) and sum(report.rejects.values()) == len(bad)


def test_missing_id_column_uses_row_numbers_and_jsonl_output(tmp_path, tiny_model, rows):
    src = write_jsonl(tmp_path / "noid.jsonl", [{"text": r["text"]} for r in rows])
    out = tmp_path / "out.jsonl"
    report, _ = run_job(small_config(src, out, tiny_model))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == list(range(len(rows)))
    assert report.rows == len(rows)


def test_empty_input_gives_empty_output(tmp_path, tiny_model):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    report, table = run_job(small_config(src, tmp_path / "out.parquet", tiny_model))
    assert report.rows == 0 and table.num_rows == 0


def test_text_column_option_and_truncation(tmp_path, tiny_model):
    long_text = " ".join(["word"] * 400)
    src = write_parquet(tmp_path / "in.parquet", [{"id": 1, "body": long_text}, {"id": 2, "body": "short"}])
    cfg = small_config(src, tmp_path / "out.parquet", tiny_model)
    from dataclasses import replace

    cfg = replace(cfg, input=replace(cfg.input, text_column="body"), tokenize=replace(cfg.tokenize, max_length=64))
    report, table = run_job(cfg)
    assert table.column("id").to_pylist() == [1, 2]
    assert report.truncated_rows == 1
    assert report.padded_tokens >= 64 and report.real_tokens == 64 + 3  # [CLS] short [SEP]
    assert pq.read_metadata(cfg.output.path).num_rows == 2
