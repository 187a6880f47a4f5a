"""One line of an OpenAI-style batch file -> the request's parts and answer options, or a reject.

A line is `{"custom_id", "method", "url", "body"}`. Three kinds of request are answered:
`/v1/embeddings` (`input`: a text or a list of texts; `dimensions`, `encoding_format`) in an
embedding run, and vLLM's `/v1/score` (`text_1`, `text_2`: a text or a list each, paired 1 with 1,
1 with N or N with N) and `/v1/rerank` (`query`, `documents`, `top_n`) in a `--task score` run.
A request of k texts or pairs becomes k parts (pipeline rows); one bad element rejects the whole
request, as OpenAI and vLLM refuse such a body, with a message naming the element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..files.row_values import check_text
from .types import OpenAIOptions, ScoreOptions

Problem = tuple[str, str]  # (reason, message)

EMBEDDINGS_URLS = ("/v1/embeddings", "/embeddings")
SCORE_URLS = ("/v1/score", "/score")
RERANK_URLS = ("/v1/rerank", "/rerank", "/v2/rerank")


@dataclass(slots=True)
class Request:
    """A valid request: its parts (texts, or [first, second] pairs) and how it wants its answer."""

    parts: list[Any]
    options: OpenAIOptions | ScoreOptions


def parse_request(line: dict[str, Any], score_run: bool) -> Request | Problem:
    """A batch line's request, or the reason it cannot be answered by this run."""
    url = line.get("url")
    body = line.get("body")
    if not isinstance(body, dict):
        return "invalid_request", "no request body (a JSON object under 'body')"
    if url is None or url in EMBEDDINGS_URLS:
        if score_run:
            return (
                "invalid_request",
                f"a {url or '/v1/embeddings'} request in a --task score run: give /v1/score or /v1/rerank",
            )
        return _embeddings(body)
    if url in SCORE_URLS or url in RERANK_URLS:
        if not score_run:
            return "invalid_request", f"a {url} request needs --task score and a cross-encoder"
        return _score(body) if url in SCORE_URLS else _rerank(body)
    answered = ", ".join((EMBEDDINGS_URLS[0], SCORE_URLS[0], RERANK_URLS[0]))
    return "invalid_request", f"url {url!r} is not answered here (only {answered})"


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    return model if isinstance(model, str) else None


def _texts(value: Any, name: str) -> list[str] | Problem:
    """A text or a non-empty list of texts; the first bad element's problem, named (`input[2]: ...`)."""
    if not isinstance(value, list):
        bad = check_text(value)
        return [value] if bad is None else (bad[0], f"{name}: {bad[1]}")
    if not value:
        return "empty_input", f"{name} is an empty list"
    for k, text in enumerate(value):
        if (bad := check_text(text)) is not None:
            return bad[0], f"{name}[{k}]: {bad[1]}"
    return value


def _embeddings(body: dict[str, Any]) -> Request | Problem:
    text = body.get("input")
    if isinstance(text, list) and not text:
        return "empty_input", "input is an empty list"
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        return "invalid_dimensions", f"dimensions must be a positive integer, got {dims!r}"
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        return "invalid_request", f"encoding_format must be float or base64, got {encoding!r}"
    if not isinstance(text, list) and (bad := check_text(text)) is not None:
        return bad  # NOTE: one text keeps the plain row's reasons and messages ("no text")
    texts = _texts(text, "input")
    if isinstance(texts, tuple):
        return texts
    return Request(texts, OpenAIOptions(dims, encoding, _model(body)))


def _score(body: dict[str, Any]) -> Request | Problem:
    sides = []
    for name in ("text_1", "text_2"):
        texts = _texts(body.get(name), name)
        if isinstance(texts, tuple):
            return texts
        sides.append(texts)
    first, second = sides
    if len(first) > 1 and len(first) != len(second):
        return "invalid_request", (
            f"text_1 has {len(first)} texts and text_2 {len(second)}: pair one text_1 with every text_2, "
            "or as many of each"
        )
    pairs = [[first[0], t] for t in second] if len(first) == 1 else [list(p) for p in zip(first, second, strict=True)]
    return Request(pairs, ScoreOptions("score", _model(body)))


def _rerank(body: dict[str, Any]) -> Request | Problem:
    query = body.get("query")
    if (bad := check_text(query)) is not None:
        return bad[0], f"query: {bad[1]}"
    documents = body.get("documents")
    if not isinstance(documents, list):
        shown = "absent" if documents is None else f"a {type(documents).__name__}"
        return "wrong_type", f"documents must be a list of texts, not {shown}"
    texts = _texts(documents, "documents")
    if isinstance(texts, tuple):
        return texts
    top_n = body.get("top_n", 0)
    top_n = 0 if top_n is None else top_n
    if isinstance(top_n, bool) or not isinstance(top_n, int):
        return "invalid_request", f"top_n must be an integer, got {top_n!r}"
    # NOTE: as vLLM: top_n 0 (or below) answers every document
    options = ScoreOptions("rerank", _model(body), max(top_n, 0), tuple(texts))
    return Request([[query, d] for d in texts], options)


__all__ = ["Request", "parse_request"]
