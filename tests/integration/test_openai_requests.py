"""OpenAI-style requests that fan out into several pipeline rows: `/v1/embeddings` with a list of
texts, vLLM's `/v1/score` (1 with N, N with N) and `/v1/rerank` (sorted, top_n), each answered
as one line; one bad element rejects its request with a message naming it, and the run goes on.

Oracles: the single-text answers and sentence-transformers' `encode` (embeddings), and
`CrossEncoder.predict` on the same pairs (scores); the answers' fields are vLLM's response models'.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict

from hpcinfer.api import run
from hpcinfer.obs.progress import Progress
from tests.fixtures.tiny_classifier import build_tiny_classifier

from ..conftest import make_texts, small_config, write_jsonl

TEXTS = make_texts(90, seed=31)
SIZES = [1, 3, 2, 5, 1, 4, 2, 1, 3, 6]  # texts per request, in turn


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScoreData(_Strict):  # vLLM's ScoreResponseData
    index: int
    object: str
    score: float


class ScoreUsage(_Strict):  # vLLM's UsageInfo, as a score answer fills it
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class ScoreResponse(_Strict):  # vLLM's ScoreResponse (`created` is optional there)
    id: str
    object: str
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(_Strict):
    text: str


class RerankResult(_Strict):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(_Strict):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Strict):  # vLLM's RerankResponse
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run_job(cfg):  # noqa: ANN201 - the report; answers are read line by line (their shapes differ)
    return run(cfg, progress=Progress("off")), None


def _answers(path) -> dict[str, dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return {x["custom_id"]: x for x in lines}


def _vector(item: dict) -> np.ndarray:
    data = item["embedding"]
    return np.frombuffer(base64.b64decode(data), "<f4") if isinstance(data, str) else np.asarray(data, np.float32)


def test_several_texts_in_one_embeddings_request(tmp_path, tiny_model):
    from openai.types import CreateEmbeddingResponse
    from sentence_transformers import SentenceTransformer

    singles = [_line(f"s{i}", "/v1/embeddings", {"model": "m", "input": t}) for i, t in enumerate(TEXTS)]
    run_job(small_config(write_jsonl(tmp_path / "one.jsonl", singles), tmp_path / "one.out.jsonl", tiny_model))
    single = _answers(tmp_path / "one.out.jsonl")
    groups, k = [], 0
    while k < len(TEXTS):
        groups.append(TEXTS[k : k + SIZES[len(groups) % len(SIZES)]])
        k += len(groups[-1])
    extras = [{}, {"dimensions": 8}, {"encoding_format": "base64"}]
    lines = [_line(f"m{g}", "/v1/embeddings", {"model": "many", "input": texts, **extras[g % 3]})
             for g, texts in enumerate(groups)]  # fmt: skip
    bad = {
        "empty": ({"input": []}, "empty_input", "input is an empty list"),
        "number": ({"input": ["a text", 7]}, "wrong_type", "input[1]: text is a int, not a string"),
        "blank": ({"input": ["a text", " "]}, "empty_text", "input[1]: text is empty or whitespace"),
        "tokens": ({"input": [[101, 102]]}, "wrong_type", "input[0]: text is a list, not a string"),
        "m0": ({"input": ["a repeated custom_id"]}, "duplicate_id", "id 'm0' appeared before"),
    }
    lines[4:4] = [_line(k, "/v1/embeddings", body) for k, (body, _, _) in bad.items()]
    lines.append(_line("scored", "/v1/score", {"text_1": "a", "text_2": "b"}))
    # NOTE: windows of 7 requests: requests of several texts fall in many windows and blocks
    cfg = small_config(write_jsonl(tmp_path / "many.jsonl", lines), tmp_path / "many.out.jsonl", tiny_model,
                       plan={"sort_window": 7, "max_batch_tokens": 512})  # fmt: skip
    report, _ = run_job(cfg)
    out = [json.loads(x) for x in (tmp_path / "many.out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out][:4] == ["m0", "m1", "m2", "m3"]
    assert len(out) == len(lines) and report.rows == len(groups)
    errors = {x["custom_id"]: (x["error"]["code"], x["error"]["message"]) for x in out if x["error"]}
    rejected_dup = [x for x in out if x["custom_id"] == "m0" and x["error"]]
    assert len(rejected_dup) == 1 and rejected_dup[0]["error"]["code"] == "duplicate_id"
    assert {k: v for k, v in errors.items() if k != "m0"} == {
        **{k: (reason, message) for k, (_, reason, message) in bad.items() if k != "m0"},
        "scored": ("invalid_request", "a /v1/score request needs --task score and a cross-encoder"),
    }
    st = SentenceTransformer(str(tiny_model), device="cpu").encode(TEXTS, convert_to_numpy=True)
    answers = {x["custom_id"]: x for x in out if x["response"] is not None}
    k = 0
    for g, texts in enumerate(groups):
        body = answers[f"m{g}"]["response"]["body"]
        if g % 3 != 2:
            CreateEmbeddingResponse.model_validate(body)
        assert [d["index"] for d in body["data"]] == list(range(len(texts)))
        usage = sum(single[f"s{k + j}"]["response"]["body"]["usage"]["prompt_tokens"] for j in range(len(texts)))
        assert body["usage"] == {"prompt_tokens": usage, "total_tokens": usage} and body["model"] == "many"
        for j, item in enumerate(body["data"]):
            want = _vector(single[f"s{k + j}"]["response"]["body"]["data"][0])
            if g % 3 == 1:
                want = want[:8] / np.linalg.norm(want[:8])
            else:
                assert np.abs(_vector(item) - st[k + j]).max() <= 1e-5
            np.testing.assert_allclose(_vector(item), want, atol=1e-6)
        k += len(texts)


def test_a_part_too_long_rejects_its_request(tmp_path, tiny_model):
    long = " ".join(["token"] * 40)
    lines = [
        _line("ok", "/v1/embeddings", {"input": ["short", "also short"]}),
        _line("long", "/v1/embeddings", {"input": ["short", long, "short"]}),
        _line("after", "/v1/embeddings", {"input": "short"}),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    cfg = small_config(src, tmp_path / "out.jsonl", tiny_model, tokenize={"max_length": 16, "on_long": "reject"})
    report, _ = run_job(cfg)
    out = _answers(tmp_path / "out.jsonl")
    assert len(out["ok"]["response"]["body"]["data"]) == 2 and out["after"]["response"] is not None
    assert out["long"]["error"] == {"code": "too_long", "message": "input[1]: longer than --max-length 16 tokens"}
    assert report.rows == 2 and report.rejects == {"too_long": 1}
    assert report.accounting["files"][0]["rejected"] == 1


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("ce") / "ce", "bert", ("LABEL_0",), seed=7)


def test_score_and_rerank_requests_equal_cross_encoder(tmp_path, scorer):
    from sentence_transformers import CrossEncoder

    queries, docs = make_texts(6, seed=41), make_texts(30, seed=42)
    lines = [
        _line("one-to-n", "/v1/score", {"model": "ce", "text_1": queries[0], "text_2": docs[:5]}),
        _line("n-to-n", "/v1/score", {"model": "ce", "text_1": queries[:4], "text_2": docs[5:9]}),
        _line("one-to-one", "/score", {"text_1": queries[1], "text_2": docs[9]}),
        _line("listed-one", "/v1/score", {"text_1": [queries[2]], "text_2": docs[10:13]}),
        _line("rerank-all", "/v1/rerank", {"model": "ce", "query": queries[3], "documents": docs[13:20]}),
        _line("rerank-top", "/v1/rerank", {"query": queries[4], "documents": docs[20:27], "top_n": 3}),
        _line("rerank-wide", "/rerank", {"query": queries[5], "documents": docs[27:30], "top_n": 10}),
    ]
    bad = {
        "no-query": ("/v1/rerank", {"documents": ["a"]}, "missing_text", "query: no text"),
        "doc-number": ("/v1/rerank", {"query": "q", "documents": ["a", 3]}, "wrong_type",
                       "documents[1]: text is a int, not a string"),
        "no-docs": ("/v1/rerank", {"query": "q", "documents": []}, "empty_input", "documents is an empty list"),
        "doc-string": ("/v1/rerank", {"query": "q", "documents": "a"}, "wrong_type",
                       "documents must be a list of texts, not a str"),
        "top-n": ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": "2"}, "invalid_request",
                  "top_n must be an integer, got '2'"),
        "lengths": ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "invalid_request",
                    "text_1 has 2 texts and text_2 3: pair one text_1 with every text_2, or as many of each"),
        "no-text-2": ("/v1/score", {"text_1": "a"}, "missing_text", "text_2: no text"),
        "embed": ("/v1/embeddings", {"input": "a"}, "invalid_request",
                  "a /v1/embeddings request in a --task score run: give /v1/score or /v1/rerank"),
        "chat": ("/v1/chat/completions", {"messages": []}, "invalid_request",
                 "url '/v1/chat/completions' is not answered here (only /v1/embeddings, /v1/score, /v1/rerank)"),
    }  # fmt: skip
    for k, (url, body, _, _) in bad.items():
        lines.insert(3, _line(k, url, body))
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    cfg = small_config(src, tmp_path / "out.jsonl", scorer, task="score", tokenize={"max_length": 48},
                       plan={"sort_window": 4})  # fmt: skip
    report, _ = run_job(cfg)
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == [line["custom_id"] for line in lines]
    answers = {x["custom_id"]: x["response"] and x["response"]["body"] for x in out}
    errors = {x["custom_id"]: (x["error"]["code"], x["error"]["message"]) for x in out if x["error"]}
    assert errors == {k: (reason, message) for k, (_, _, reason, message) in bad.items()}
    assert report.rows == 7 and sum(report.rejects.values()) == len(bad)

    ce = CrossEncoder(str(scorer), max_length=48, device="cpu")
    for name, pairs in {
        "one-to-n": [(queries[0], d) for d in docs[:5]],
        "n-to-n": list(zip(queries[:4], docs[5:9], strict=True)),
        "one-to-one": [(queries[1], docs[9])],
        "listed-one": [(queries[2], d) for d in docs[10:13]],
    }.items():
        body = ScoreResponse.model_validate(answers[name]).model_dump()
        assert [d["index"] for d in body["data"]] == list(range(len(pairs)))
        assert {d["object"] for d in body["data"]} == {"score"} and body["object"] == "list"
        got = np.array([d["score"] for d in body["data"]])
        assert np.abs(got - ce.predict(pairs)).max() <= 1e-5, name
        assert body["usage"]["prompt_tokens"] > 0
    assert answers["one-to-n"]["model"] == "ce" and answers["one-to-one"]["model"] == str(scorer)
    for name, query, documents, top_n in [
        ("rerank-all", queries[3], docs[13:20], 7),
        ("rerank-top", queries[4], docs[20:27], 3),
        ("rerank-wide", queries[5], docs[27:30], 3),
    ]:
        body = RerankResponse.model_validate(answers[name]).model_dump()
        theirs = ce.predict([(query, d) for d in documents])
        order = np.argsort(-theirs, kind="stable")[:top_n].tolist()
        assert [r["index"] for r in body["results"]] == order, name
        assert [r["document"]["text"] for r in body["results"]] == [documents[k] for k in order]
        got = np.array([r["relevance_score"] for r in body["results"]])
        assert np.abs(got - theirs[order]).max() <= 1e-5
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    # usage: every pair's tokens as the model saw them (truncated to --max-length)
    pair = ce.tokenizer(queries[1], docs[9], truncation=True, max_length=48)
    assert answers["one-to-one"]["usage"]["prompt_tokens"] == len(pair["input_ids"]) == 48


def test_kill_and_resume_gives_one_answer_per_request(tmp_path, tiny_model):
    """kill -9 with a window half committed (a part written, not yet in the manifest), then
    --resume: every request answered exactly once, the output byte for byte the uninterrupted one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    texts = make_texts(400, seed=33)
    lines, k = [], 0
    while k < len(texts):
        size = SIZES[len(lines) % len(SIZES)]
        lines.append(_line(f"q{len(lines)}", "/v1/embeddings", {"input": texts[k : k + size]}))
        k += size
    lines[9]["body"]["input"] = ["fine", ""]  # a rejected request, which must survive the kill too
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    args = [str(src), "--model", str(tiny_model), "--sort-window", "10", "--max-batch-tokens", "512"]
    args += ["--progress", "off", "-q"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    crash = [str(Path(__file__).with_name("crash_run.py")), "part_written", "4"]

    def hpcinfer(*more: str, head: list[str] | None = None) -> subprocess.CompletedProcess:
        command = [sys.executable, *(head or ["-m", "hpcinfer", "run"]), *args, *more]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    reference = tmp_path / "reference.jsonl"
    assert hpcinfer("-o", str(reference)).returncode == 0
    out = tmp_path / "out.jsonl"
    killed = hpcinfer("-o", str(out), head=crash)
    assert killed.returncode == -9, killed.stderr
    manifest = json.loads((tmp_path / "out.jsonl.parts" / "manifest.json").read_text())
    assert len(manifest["windows"]) == 3  # the fourth window's part was written, never committed
    done = hpcinfer("-o", str(out), "--resume", "--report", str(tmp_path / "report.json"))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference.read_bytes()
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert ids == [line["custom_id"] for line in lines]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rows_resumed"] == report["accounting"]["rows_resumed"] == 30  # three windows' requests
    assert report["accounting"]["balanced"]


def test_online_replay_releases_whole_requests(tmp_path, tiny_model):
    """Under --rate a request's texts arrive together: the answers equal the offline run's."""
    lines = [_line(f"r{i}", "/v1/embeddings", {"input": TEXTS[i : i + 1 + i % 4]}) for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    run_job(small_config(src, tmp_path / "offline.jsonl", tiny_model))
    run_job(small_config(src, tmp_path / "online.jsonl", tiny_model, input={"rate": 4000.0}))
    offline, online = _answers(tmp_path / "offline.jsonl"), _answers(tmp_path / "online.jsonl")
    assert list(online) == list(offline) == [line["custom_id"] for line in lines]
    for key, answer in online.items():
        data = answer["response"]["body"]["data"]
        assert len(data) == 1 + int(key[1:]) % 4
        for x, y in zip(data, offline[key]["response"]["body"]["data"], strict=True):
            np.testing.assert_allclose(_vector(x), _vector(y), atol=1e-6)
