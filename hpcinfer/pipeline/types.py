"""The plain data types passed between the encoder pipeline's stages. No I/O here.

Batches are variable-length first (flat token ids + offsets); padding is decided by the planner
and recorded in the batch, never guessed downstream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..types import Reject


@dataclass(frozen=True, slots=True)
class OpenAIOptions:
    """How an OpenAI `/v1/embeddings` request wants its answer: `dimensions` (None: all),
    `encoding_format` (float or base64) and the `model` name it gave."""

    dimensions: int | None = None
    encoding_format: str = "float"
    model: str | None = None


@dataclass(frozen=True, slots=True)
class ScoreOptions:
    """How a vLLM-style `/v1/score` or `/v1/rerank` request wants its answer: `kind` (score or
    rerank), the `model` name it gave, rerank's `top_n` (0: every document) and its documents
    (the answer shows each one's text)."""

    kind: str
    model: str | None = None
    top_n: int = 0
    documents: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestPart:
    """One pipeline row of a request that fans out into several (each text of an `input` list, each
    pair of a score or rerank body): the request's answer options (shared by its parts), this
    part's place in the request and the request's number of parts.

    NOTE: a request's parts are consecutive rows under one input row number; windows end only on
    input-row edges, so a request is committed whole or not at all (fanout.py)."""

    request: Any  # OpenAIOptions or ScoreOptions
    index: int
    count: int


@dataclass(slots=True)
class TokenBlock:
    """tokenize -> plan: the token ids of a RowBlock, flat."""

    block_id: int
    first_row: int
    input_rows: int
    ids: list[Any]
    flat_ids: np.ndarray  # int32 [total_tokens]
    lengths: np.ndarray  # int32 [rows]
    truncated: int = 0  # rows cut to max_length
    rejects: list[Reject] = field(default_factory=list)
    rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # input row numbers
    source: str = ""
    arrival_ns: np.ndarray | None = None
    file_first_row: int = 0
    options: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class Window:
    """A run of consecutive rows sorted and batched together; the unit of ordering and commit."""

    window_id: int
    first_row: int
    input_rows: int  # NOTE: windows cover exactly sort_window input rows (the last may be shorter)
    ids: list[Any]
    flat_ids: np.ndarray  # int32 [total_tokens]
    offsets: np.ndarray  # int64 [rows + 1]
    block_ids: np.ndarray  # int64 [rows]: the read block each row came from
    rows: np.ndarray  # int64 [rows]: input row numbers
    sources: dict[int, str] = field(default_factory=dict)  # block id -> input file
    file_first_rows: dict[int, int] = field(default_factory=dict)  # block id -> global row where its file starts
    rejects: list[Reject] = field(default_factory=list)
    num_batches: int = 0
    arrival_ns: np.ndarray | None = None  # int64 [rows], under --rate: per-request latency starts here
    options: list[Any] | None = None  # per row: its RequestPart (RowBlock.options)
    cut_tokens: int = 0  # the token budget its batches were cut to (a resumed window is cut alike)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class Batch:
    """plan -> stage: rows of one window, padded to one length."""

    batch_id: int
    window: Window
    rows: np.ndarray  # int64 [n]: window-local row indices
    lengths: np.ndarray  # int32 [n]
    padded_len: int
    closed_ns: int = 0  # when the planner closed it
    started_ns: int = 0  # when its ids went into a staging slot: per-batch latency starts here

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        return self.num_rows * self.padded_len


@dataclass(slots=True)
class Staged:
    """stage -> execute: a batch whose ids sit in a staging slot, copy issued."""

    batch: Batch
    slot: Any  # device.StagingSlot
    h2d_start: Any  # device events
    h2d_done: Any


@dataclass(slots=True)
class Pending:
    """execute -> write: results on their way to host memory, guarded by d2h_done."""

    batch: Batch
    out: Any  # device.OutputBuffer holding [rows, dim] once out.events["d2h_done"] completes
    stream: int = 0
    failed_rows: list[int] = field(default_factory=list)  # batch positions that could not run (oom)
    splits: list[int] = field(default_factory=lambda: [0])  # out-of-memory splits while running
    replica: int = 0  # which device ran it (several devices: see dispatch.py)
