"""Answers to vLLM-style `/v1/score` and `/v1/rerank` requests of an OpenAI batch file (`--task score`).

A `/v1/score` answer is vLLM's `ScoreResponse`: `{"id", "object": "list", "model", "data":
[{"index", "object": "score", "score"}] (one per pair, in pair order), "usage"}`. A
`/v1/rerank` answer is its `RerankResponse`: `{"id", "model", "usage", "results": [{"index",
"document": {"text"}, "relevance_score"}]}`, sorted by score, highest first (ties in document
order), cut to `top_n` when it is set. `usage.prompt_tokens` counts every pair's tokens.
NOTE: no `created` time stamp (vLLM's is optional): the same input gives the same bytes, so a
resumed run's output equals an uninterrupted one's; ids are the request's row (`score-12`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...pipeline.fanout import RequestAnswerStore, answer_line
from ...pipeline.types import ScoreOptions


def score_body(row: int, scores: list[float], tokens: int, options: ScoreOptions, model: str) -> dict[str, Any]:
    """The body of one `/v1/score` answer."""
    return {
        "id": f"score-{row}",
        "object": "list",
        "model": options.model or model,
        "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


def rerank_body(row: int, scores: list[float], tokens: int, options: ScoreOptions, model: str) -> dict[str, Any]:
    """The body of one `/v1/rerank` answer: documents by relevance, highest first, `top_n` of them."""
    order = sorted(range(len(scores)), key=lambda k: -scores[k])  # NOTE: stable: ties keep document order
    if 0 < options.top_n < len(order):
        order = order[: options.top_n]
    results = [{"index": k, "document": {"text": options.documents[k]}, "relevance_score": scores[k]} for k in order]
    return {
        "id": f"rerank-{row}",
        "model": options.model or model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


class ScoreAnswerStore(RequestAnswerStore):
    """Answers to `/v1/score` and `/v1/rerank` requests: the cross-encoder's one value per pair."""

    def answer(self, row: int, custom_id: Any, values: np.ndarray, tokens: int, options: Any) -> dict[str, Any]:
        scores = [float(v) for v in values[:, 0]]
        make = rerank_body if options.kind == "rerank" else score_body
        return answer_line(row, custom_id, make(row, scores, tokens, options, self.model))


__all__ = ["ScoreAnswerStore", "rerank_body", "score_body"]
