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
from typing import Any

import numpy as np

from ...pipeline.fanout import RequestAnswerStore, answer_line
from ...pipeline.types import OpenAIOptions


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


class OpenAIEmbeddingStore(RequestAnswerStore):
    """Answers to `/v1/embeddings` requests."""

    def __init__(self, output: str, dim: int, fp: dict[str, Any], model: str, normalize: bool) -> None:
        super().__init__(output, dim, fp, model)
        self.normalize = normalize

    def answer(self, row: int, custom_id: Any, values: np.ndarray, tokens: int, options: Any) -> dict[str, Any]:
        return embedding_answer(row, custom_id, values, tokens, options, self.model, self.normalize)


__all__ = ["OpenAIEmbeddingStore", "embedding_answer"]
