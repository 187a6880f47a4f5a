"""Answers to an OpenAI batch file of `/v1/embeddings` requests, one JSON line per request.

Each answered request is a batch output line (`custom_id`, `response.status_code` 200,
`response.body` a `CreateEmbeddingResponse`: one `data` entry per text of its `input`, `index` in
input order, `model`, `usage` summed over its texts), its `dimensions` cut from the run's vectors
(and re-normalised when the run normalises, as OpenAI's shortened embeddings are) and encoded as
`encoding_format` asks (a list of floats, or base64 of little-endian float32). A rejected request
is a line too, in the batch API's error format (`"response": null`, `"error": {code, message}`),
so the output has one line per request.
"""

from __future__ import annotations

import base64
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from ...files.parts import PartStore
from ...types import OpenAIOptions
from .fanout import split_values


def embedding_answer(
    row: int, custom_id: Any, vectors: np.ndarray, tokens: int, options: OpenAIOptions, model: str, normalize: bool
) -> dict[str, Any]:
    """One request's batch output line; `vectors` [texts, dim]: one per text of its input, in order."""
    if options.dimensions is not None and options.dimensions < vectors.shape[1]:
        vectors = vectors[:, : options.dimensions]
        if normalize:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    vectors = vectors.astype("<f4")
    data = [
        {"object": "embedding", "index": k, "embedding": _encoded(vector, options.encoding_format)}
        for k, vector in enumerate(vectors)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": options.model or model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return answer_line(row, custom_id, body)


def _encoded(vector: np.ndarray, encoding_format: str) -> Any:
    return base64.b64encode(vector.tobytes()).decode("ascii") if encoding_format == "base64" else vector.tolist()


def answer_line(row: int, custom_id: Any, body: dict[str, Any]) -> dict[str, Any]:
    """An answered request's batch output line."""
    response = {"status_code": 200, "request_id": f"req_{row}", "body": body}
    return {"id": f"batch_req_{row}", "custom_id": custom_id, "response": response, "error": None}


def error_line(reject: dict[str, Any]) -> dict[str, Any]:
    """A rejected request's batch output line."""
    error = {"code": reject["reason"], "message": reject["message"]}
    return {"id": f"batch_req_{reject['row']}", "custom_id": reject["id"], "response": None, "error": error}


class RequestAnswerStore(PartStore, ABC):
    """Parts of answers to OpenAI-style requests: JSON lines, answered and rejected requests in
    input order. `values` hold every part of the window's answered requests; `meta["counts"]` says
    how many parts each request has, in order (tasks/embed/fanout.py)."""

    def __init__(self, output: str, dim: int, fp: dict[str, Any], model: str) -> None:
        super().__init__(output, "jsonl", dim, fp)
        self.model = model
        self.id_column = "custom_id"

    @abstractmethod
    def answer(self, row: int, custom_id: Any, values: np.ndarray, tokens: int, options: Any) -> dict[str, Any]:
        """One answered request's line, from its parts' values [parts, dim] (each endpoint's own shape)."""

    def _write_part(
        self, tmp: Path, ids: list[Any], values: np.ndarray, meta: dict[str, list[Any]] | None, rejects: list[Any]
    ) -> None:
        assert meta is not None, "requests carry their options"
        groups = split_values(values, meta["counts"])
        rows = zip(ids, meta["rows"], meta["tokens"], meta["options"], groups, strict=True)
        answers = [(row, self.answer(row, i, group, tokens, options)) for i, row, tokens, options, group in rows]
        lines = sorted([*answers, *((r["row"], error_line(r)) for r in rejects)], key=lambda item: item[0])
        tmp.write_text("".join(json.dumps(line) + "\n" for _, line in lines), encoding="utf-8")


class OpenAIEmbeddingStore(RequestAnswerStore):
    """Answers to `/v1/embeddings` requests."""

    def __init__(self, output: str, dim: int, fp: dict[str, Any], model: str, normalize: bool) -> None:
        super().__init__(output, dim, fp, model)
        self.normalize = normalize

    def answer(self, row: int, custom_id: Any, values: np.ndarray, tokens: int, options: Any) -> dict[str, Any]:
        return embedding_answer(row, custom_id, values, tokens, options, self.model, self.normalize)


__all__ = ["OpenAIEmbeddingStore", "RequestAnswerStore", "answer_line", "embedding_answer", "error_line"]
