"""The plain data types passed between stages. No I/O here.

Batches are variable-length first (flat token ids + offsets); padding is decided by the planner
and recorded in the batch, never guessed downstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class End:
    """Marks the end of a stream on a queue."""

    def __repr__(self) -> str:
        return "END"


END = End()


@dataclass(slots=True)
class RowBlock:
    """read -> tokenize: consecutive input rows, in input order."""

    block_id: int
    first_row: int  # global 0-based index of the first row
    source: str
    ids: list[Any]
    texts: list[str] | None = None
    token_ids: tuple[np.ndarray, np.ndarray] | None = None  # pre-tokenized: (flat int32, lengths)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class TokenBlock:
    """tokenize -> plan: the token ids of a RowBlock, flat."""

    block_id: int
    first_row: int
    ids: list[Any]
    flat_ids: np.ndarray  # int32 [total_tokens]
    lengths: np.ndarray  # int32 [rows]
    truncated: int = 0  # rows cut to max_length

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class Window:
    """A run of consecutive rows sorted and batched together; the unit of ordering and commit."""

    window_id: int
    first_row: int
    ids: list[Any]
    flat_ids: np.ndarray  # int32 [total_tokens]
    offsets: np.ndarray  # int64 [rows + 1]
    block_ids: np.ndarray  # int64 [rows]: the read block each row came from
    num_batches: int = 0

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
