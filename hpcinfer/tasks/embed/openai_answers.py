"""Answers to an OpenAI batch file of `/v1/embeddings` requests, one JSON line per request.

Each answered request is a batch output line (`custom_id`, `response.status_code` 200,
`response.body` a `CreateEmbeddingResponse`: `data[0].embedding`, `model`, `usage`), its
`dimensions` cut from the run's vector (and re-normalised when the run normalises, as OpenAI's
shortened embeddings are) and encoded as `encoding_format` asks (a list of floats, or base64 of
little-endian float32). A rejected request is a line too, in the batch API's error format
(`"response": null`, `"error": {code, message}`), so the output has one line per request.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from ...files.parts import PartStore
from ...types import OpenAIOptions


def embedding_answer(
    row: int, custom_id: Any, vector: np.ndarray, tokens: int, options: OpenAIOptions, model: str, normalize: bool
) -> dict[str, Any]:
    """One request's batch output line."""
    if options.dimensions is not None and options.dimensions < len(vector):
        vector = vector[: options.dimensions]
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    vector = vector.astype("<f4")
    encoded: Any = base64.b64encode(vector.tobytes()).decode("ascii") if options.encoding_format == "base64" else None
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector.tolist() if encoded is None else encoded}],
        "model": options.model or model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    response = {"status_code": 200, "request_id": f"req_{row}", "body": body}
    return {"id": f"batch_req_{row}", "custom_id": custom_id, "response": response, "error": None}


def error_line(reject: dict[str, Any]) -> dict[str, Any]:
    """A rejected request's batch output line."""
    error = {"code": reject["reason"], "message": reject["message"]}
    return {"id": f"batch_req_{reject['row']}", "custom_id": reject["id"], "response": None, "error": error}


class OpenAIEmbeddingStore(PartStore):
    """Parts of OpenAI embedding answers: JSON lines, answered and rejected requests in input order."""

    def __init__(self, output: str, dim: int, fp: dict[str, Any], model: str, normalize: bool) -> None:
        super().__init__(output, "jsonl", dim, fp)
        self.model, self.normalize = model, normalize
        self.id_column = "custom_id"

    def _write_part(
        self, tmp: Path, ids: list[Any], values: np.ndarray, meta: dict[str, list[Any]] | None, rejects: list[Any]
    ) -> None:
        assert meta is not None, "OpenAI rows carry their options"
        rows = zip(ids, meta["rows"], meta["tokens"], meta["options"], strict=True)
        answers = [
            (row, embedding_answer(row, i, values[k], tokens, options, self.model, self.normalize))
            for k, (i, row, tokens, options) in enumerate(rows)
        ]
        lines = sorted([*answers, *((r["row"], error_line(r)) for r in rejects)], key=lambda item: item[0])
        tmp.write_text("".join(json.dumps(line) + "\n" for _, line in lines), encoding="utf-8")


__all__ = ["OpenAIEmbeddingStore", "embedding_answer"]
