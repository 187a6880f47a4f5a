"""Stage 3, plan: TokenBlocks -> Batches.

Collects `sort_window` rows into a Window, sorts them by token length (longest first, so memory
peaks show up at once) and cuts batches to a token budget that counts padding:
rows x padded_len <= max_batch_tokens, with padded_len rounded up to `pad_multiple`.
Pure numpy; no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np

from .config import PlanConfig
from .types import Batch, Reject, TokenBlock, Window


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cut_batches(lengths: np.ndarray, max_tokens: int, max_rows: int, pad_multiple: int) -> list[tuple[np.ndarray, int]]:
    """Window-local row indices of each batch, and its padded length.

    Rows are taken longest first and grouped into length buckets (rows with the same padded
    length); each bucket is cut into batches of as many rows as the budget allows. A batch never
    spans two buckets, so no row is padded past its own bucket: padding is only the rounding.
    """
    if len(lengths) == 0:
        return []
    order = np.argsort(-lengths.astype(np.int64), kind="stable")
    sorted_lengths = lengths[order]
    padded = -(-sorted_lengths // pad_multiple) * pad_multiple
    batches: list[tuple[np.ndarray, int]] = []
    i, n = 0, len(order)
    while i < n:
        width = int(padded[i])
        capacity = max(1, min(max_rows, max_tokens // width))
        end = min(n, i + capacity)
        end = min(end, int(np.searchsorted(-padded, -width, side="right")))  # bucket edge
        batches.append((order[i:end], width))
        i = end
    return batches


class TokenBudget:
    """The running token budget; lowered (never raised) after an out-of-memory split."""

    def __init__(self, tokens: int, floor: int) -> None:
        self._tokens = tokens
        self._floor = floor
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self._tokens

    def lower(self, failed_tokens: int) -> None:
        with self._lock:
            self._tokens = max(self._floor, min(self._tokens, failed_tokens // 2))


class Planner:
    """Consumes TokenBlocks, produces Batches window by window, in window order.

    A window is exactly `sort_window` input rows (the last may be shorter); a window whose rows
    were all rejected still produces one empty batch, so its rejects are committed in order.
    """

    name = "plan"

    def __init__(
        self,
        cfg: PlanConfig,
        budget: TokenBudget | None = None,
        first_window: int = 0,
        on_rejects: Callable[[list[Reject]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_rejects = on_rejects  # counts rejects as soon as they are known (--max-rejects)
        self.budget = budget or TokenBudget(cfg.max_batch_tokens, cfg.max_batch_tokens)
        self._blocks: list[TokenBlock] = []
        self._window_id = first_window
        self.windows = 0
        self._batch_id = 0

    def process(self, block: TokenBlock) -> Iterator[Batch]:
        if block.rejects and self.on_rejects is not None:
            self.on_rejects(block.rejects)
        self._blocks.append(block)
        if (block.first_row + block.input_rows) % self.cfg.sort_window == 0:
            yield from self._flush()

    def finish(self) -> Iterator[Batch]:
        if self._blocks:
            yield from self._flush()

    def _flush(self) -> Iterator[Batch]:
        blocks, self._blocks, self._rows = self._blocks, [], 0
        lengths = np.concatenate([b.lengths for b in blocks])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        window = Window(
            window_id=self._window_id,
            first_row=blocks[0].first_row,
            input_rows=sum(b.input_rows for b in blocks),
            rejects=[r for b in blocks for r in b.rejects],
            rows=np.concatenate([b.rows for b in blocks]),
            sources={b.block_id: b.source for b in blocks},
            ids=[i for b in blocks for i in b.ids],
            flat_ids=np.concatenate([b.flat_ids for b in blocks]),
            offsets=offsets,
            block_ids=np.repeat([b.block_id for b in blocks], [len(b) for b in blocks]),
        )
        self._window_id += 1
        self.windows += 1
        cuts = cut_batches(lengths, self.budget.tokens, self.cfg.max_batch_size, self.cfg.pad_multiple)
        if not cuts:
            cuts = [(np.empty(0, dtype=np.int64), self.cfg.pad_multiple)]
        window.num_batches = len(cuts)
        for rows, width in cuts:
            yield Batch(self._batch_id, window, rows, lengths[rows], width)
            self._batch_id += 1
