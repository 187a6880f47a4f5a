"""Requests that fan out into several pipeline rows, gathered back per request.

An OpenAI-style request of k texts or pairs is k rows of the pipeline (each is tokenized, sorted
into a batch by its own length and run), all under the request's one input row number, each
carrying a `RequestPart` (the request's options, its index, the count). Everything that is
counted or committed stays per request:

- a part that fails (tokenizer refusal, too long under --on-long reject, out of memory, too many
  dimensions) rejects its whole request, once, naming the part; its other parts are dropped;
- the writer commits one output row per request: its id once, its parts' vectors in part order
  (values of all parts, `counts` saying how many each request has), its tokens summed.

Windows end only on input-row edges and a read block holds whole requests, so a request's parts
always share a window: a window commits whole requests or none, and --resume (which skips whole
committed windows of input rows) never redoes or loses a part of one.

`RequestAnswerStore` writes a window's requests back as OpenAI batch output lines, answered and
rejected in input order; each endpoint (tasks/embed, tasks/score) says how one request's answer looks.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from ..files.parts import PartStore
from .types import RequestPart, ScoreOptions

Problem = tuple[str, str]


def part_name(part: Any) -> str:
    """How a part is named in a reject message: `input[2]`, `documents[2]`, `pair 2`."""
    request = part.request
    if isinstance(request, ScoreOptions):
        return f"documents[{part.index}]" if request.kind == "rerank" else f"pair {part.index}"
    return f"input[{part.index}]"


def whole_requests(
    bad: dict[int, Problem], rows: Any, options: list[Any] | None, *, name_parts: bool = True
) -> tuple[dict[int, Problem], set[int]]:
    """Per-part problems -> one problem per request (at its first bad part, the part named unless the
    problem is the request's own) and the set of every row to drop (all parts of each such request).
    `rows`: each row's input row."""
    if not bad or options is None:
        return bad, set(bad)
    rows = np.asarray(rows)
    first: dict[int, Problem] = {}
    drop: set[int] = set()
    seen_rows: set[int] = set()
    for i, (reason, message) in sorted(bad.items()):
        row = int(rows[i])
        if row in seen_rows:
            continue
        seen_rows.add(row)
        part = options[i]
        named = f"{part_name(part)}: {message}" if name_parts and part.count > 1 else message
        first[i] = (reason, named)
        drop.update(np.flatnonzero(rows == row).tolist())
    return first, drop


def request_firsts(options: list[Any], keep: np.ndarray) -> np.ndarray:
    """Window rows that begin a kept request (its part 0)."""
    index = np.fromiter((p.index for p in options), np.int64, len(options))
    return np.flatnonzero(keep & (index == 0))


def gathered_meta(options: list[RequestPart], rows: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> dict:
    """The writer's per-request facts of a window's kept rows: options, input row, part count, tokens."""
    firsts = request_firsts(options, keep)
    counts = [options[i].count for i in firsts.tolist()]
    kept = np.flatnonzero(keep)
    assert len(kept) == sum(counts), "a request is kept whole or not at all"
    tokens = np.add.reduceat(lengths[kept], np.cumsum([0, *counts[:-1]])).tolist() if counts else []
    return {
        "options": [options[i].request for i in firsts.tolist()],
        "rows": rows[firsts].tolist(),
        "tokens": [int(t) for t in tokens],
        "counts": counts,
    }


def split_values(values: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """A window's part values [parts, dim] -> one array [count, dim] per request, in request order."""
    return np.split(values, np.cumsum(counts)[:-1]) if counts else []


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
    how many parts each request has, in order (above)."""

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


__all__ = [
    "RequestAnswerStore",
    "answer_line",
    "error_line",
    "gathered_meta",
    "part_name",
    "request_firsts",
    "split_values",
    "whole_requests",
]
