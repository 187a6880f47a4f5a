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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...types import RequestPart, ScoreOptions

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


__all__ = ["gathered_meta", "part_name", "request_firsts", "split_values", "whole_requests"]
