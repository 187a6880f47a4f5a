"""The plain data types every task's rows pass as: the end of a stream, a rejected row, and a
block of rows as read. No I/O here. The encoder pipeline's own types (token blocks, windows,
batches) are in pipeline/types.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class End:
    """Marks the end of a stream on a queue."""

    def __repr__(self) -> str:
        return "END"


END = End()


@dataclass(slots=True)
class Reject:
    """An input row that cannot be processed; it goes to the rejects file, never silently away."""

    row: int  # global 0-based input row number
    source: str
    line: int | None  # 1-based line in a JSONL file; None for Parquet
    id: Any
    reason: str  # a code from REJECT_REASONS
    message: str
    row_in_file: int | None = None  # 0-based row within `source` (the global row less the rows before it)

    def to_json(self) -> dict[str, Any]:
        where: dict[str, Any] = {"row_in_file": self.row if self.row_in_file is None else self.row_in_file}
        if self.line is not None:
            where["line"] = self.line
        return {
            "row": self.row,
            "source": self.source,
            **where,
            "id": self.id,
            "reason": self.reason,
            "message": self.message,
        }


REJECT_REASONS = (
    "malformed_json",
    "missing_text",
    "wrong_type",
    "empty_text",
    "invalid_utf8",
    "invalid_unicode",
    "invalid_id",
    "tokenize_error",
    "invalid_token_ids",
    "invalid_prompt",
    "duplicate_id",
    "too_long",
    "oom",
    "empty_input",  # an OpenAI-style request with an empty list (`input`, `text_1`, `documents`)
    "invalid_request",  # an OpenAI-style request's other fields (url, encoding_format, top_n, pairing)
    "invalid_dimensions",  # `dimensions` below 1 or above the model's
    "image_missing",  # --image-column: no image at the row's path, or no path
    "image_unreadable",  # not an image, truncated, or too large to decode
    "image_remote",  # an http(s) URL: a job reads local files and object stores, never the web
)


@dataclass(slots=True)
class RowBlock:
    """read -> tokenize: consecutive input rows, in input order; bad rows already set aside."""

    block_id: int
    first_row: int  # global 0-based index of the block's first input row
    input_rows: int  # input rows covered, rejects included
    source: str
    ids: list[Any]  # ids of the valid rows
    texts: list[str] | None = None
    prompts: list[str | None] | None = None  # each text's own prompt (--prompt-column), None: the run's
    token_ids: tuple[np.ndarray, np.ndarray] | None = None  # pre-tokenized: (flat int32, lengths)
    images: list[Any] | None = None  # --image-column: each valid row's image (a path, URI or bytes)
    rejects: list[Reject] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # input row number of each valid row
    lines: list[int | None] = field(default_factory=list)  # and its JSONL line, if any
    arrival_ns: np.ndarray | None = None  # int64 [rows]: when each request arrived (--rate replay)
    file_first_row: int = 0  # global row number of the first row of `source`
    options: list[Any] | None = None  # per valid row (a request's part): its RequestPart

    def __len__(self) -> int:
        return len(self.ids)
