"""Stage 3, plan: TokenBlocks -> Batches.

Collects `sort_window` rows into a Window, sorts them by token length (longest first, so memory
peaks show up at once) and cuts batches to a token budget that counts padding:
rows x padded_len <= max_batch_tokens, with padded_len rounded up to `pad_multiple`.
Pure numpy; no torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .config import PlanConfig
from .types import Batch, TokenBlock, Window


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


class Planner:
    """Consumes TokenBlocks, produces Batches window by window, in window order."""

    name = "plan"

    def __init__(self, cfg: PlanConfig) -> None:
        self.cfg = cfg
        self._blocks: list[TokenBlock] = []
        self._rows = 0
        self._window_id = 0
        self._batch_id = 0

    def process(self, block: TokenBlock) -> Iterator[Batch]:
        self._blocks.append(block)
        self._rows += len(block)
        if self._rows >= self.cfg.sort_window:
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
            ids=[i for b in blocks for i in b.ids],
            flat_ids=np.concatenate([b.flat_ids for b in blocks]),
            offsets=offsets,
            block_ids=np.repeat([b.block_id for b in blocks], [len(b) for b in blocks]),
        )
        self._window_id += 1
        cuts = cut_batches(lengths, self.cfg.max_batch_tokens, self.cfg.max_batch_size, self.cfg.pad_multiple)
        window.num_batches = len(cuts)
        for rows, width in cuts:
            yield Batch(self._batch_id, window, rows, lengths[rows], width)
            self._batch_id += 1
