"""Stage 3, plan: TokenBlocks -> Batches.

Collects `sort_window` rows into a Window, sorts them by token length (longest first, so memory
peaks show up at once) and cuts batches to a token budget that counts padding:
rows x padded_len <= max_batch_tokens, with padded_len rounded up to `pad_multiple`.

Online mode (`--rate`): requests trickle in, so a window closes as soon as its rows fill one
batch (the token budget or the row cap) or its oldest request has waited `batch_timeout_ms`,
whichever comes first. The timeout also applies without `--rate`: it bounds how long rows wait
in the planner for the reader and tokenizer. Pure numpy; no torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ..config import PlanConfig
from ..types import Reject
from .types import Batch, TokenBlock, Window

if TYPE_CHECKING:
    from .held import Held


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def max_padded_len(max_length: int, pad_multiple: int, positions: int) -> int:
    """The widest batch: max_length rounded up to pad_multiple, but never past the model's positions.

    NOTE: a width beyond `max_position_embeddings` indexes past the position table: an IndexError
    on CPU, a device-side assert that poisons the whole CUDA context on a GPU. Rows are never longer
    than max_length (<= positions), so clamping only trims padding.
    """
    assert max_length <= positions, "checked at start-up"
    return min(round_up(max_length, pad_multiple), positions)


def cut_batches(
    lengths: np.ndarray,
    max_tokens: int,
    max_rows: int,
    pad_multiple: int,
    bucket_edges: bool = True,
    max_width: int | None = None,
) -> list[tuple[np.ndarray, int]]:
    """Window-local row indices of each batch, and its padded length.

    Rows are taken longest first and grouped into length buckets (rows with the same padded
    length); each bucket is cut into batches of as many rows as the budget allows. A batch never
    spans two buckets, so no row is padded past its own bucket: padding is only the rounding.
    Without `bucket_edges` (online mode, where a window is about one batch) a batch takes as many
    of the next-longest rows as the budget allows, padded to its longest. Padded lengths are capped
    at `max_width` (see max_padded_len).
    """
    if len(lengths) == 0:
        return []
    order = np.argsort(-lengths.astype(np.int64), kind="stable")
    sorted_lengths = lengths[order]
    padded = -(-sorted_lengths // pad_multiple) * pad_multiple
    if max_width is not None:
        padded = np.minimum(padded, max_width)
    batches: list[tuple[np.ndarray, int]] = []
    i, n = 0, len(order)
    while i < n:
        width = int(padded[i])
        capacity = max(1, min(max_rows, max_tokens // width))
        end = min(n, i + capacity)
        if bucket_edges:
            end = min(end, int(np.searchsorted(-padded, -width, side="right")))
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


class ClosingRule:
    """When pending rows become a window: full (token budget or row cap) or timed out."""

    def __init__(
        self,
        budget: TokenBudget,
        max_rows: int,
        pad_multiple: int,
        timeout_ms: float | None,
        max_width: int | None = None,
    ) -> None:
        self.budget = budget
        self.max_rows = max_rows
        self.pad_multiple = pad_multiple
        self.max_width = max_width
        self.timeout_ns = None if timeout_ms is None else int(timeout_ms * 1e6)

    def padded_tokens(self, rows: int, longest: int) -> int:
        width = round_up(max(longest, 1), self.pad_multiple)
        return rows * (width if self.max_width is None else min(width, self.max_width))

    def fits(self, rows: int, longest: int) -> bool:
        """One batch can hold `rows` rows padded to `longest`."""
        return rows <= self.max_rows and self.padded_tokens(rows, longest) <= self.budget.tokens

    def full(self, rows: int, longest: int) -> bool:
        """Nothing more fits: the row cap is reached or the next pad multiple would break the budget."""
        return rows >= self.max_rows or self.padded_tokens(rows + 1, longest) > self.budget.tokens

    def deadline(self, oldest_ns: int | None) -> int | None:
        if self.timeout_ns is None or oldest_ns is None:
            return None
        return oldest_ns + self.timeout_ns


class Planner:
    """Consumes TokenBlocks, produces Batches window by window, in window order.

    A window is at most `sort_window` input rows and never crosses a multiple of it, so without a
    timeout or `online` windows are exactly `sort_window` rows (the last may be shorter). A window
    whose rows were all rejected still produces one empty batch, so its rejects are committed in
    order. `online` closes a window once its rows fill a batch; `timeout_ms` once its oldest row
    (its arrival under --rate, else when the planner got it) has waited that long. The pipeline
    calls `tick` at `deadline_ns()` when no new block has come by then.

    `held` (a resumed run; shared with the writer) maps a window id to the rows that checkpoints
    of the interrupted run hold and the token budget its batches were cut to: the window is cut to
    that budget again, so its batches are the very same, and those whose rows are all held are not
    emitted (a window left with none emits one empty batch, so it is committed all the same). A
    held entry that is not this window (other input rows) is dropped, and the window computed whole.
    """

    name = "plan"

    def __init__(
        self,
        cfg: PlanConfig,
        budget: TokenBudget | None = None,
        first_window: int = 0,
        on_rejects: Callable[[list[Reject]], None] | None = None,
        *,
        online: bool = False,
        timeout_ms: float | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
        max_width: int | None = None,
        held: dict[int, Held] | None = None,
    ) -> None:
        self.cfg = cfg
        self.held = held if held is not None else {}
        self.max_width = max_width  # the widest padded length the model can take (max_padded_len)
        self.on_rejects = on_rejects  # counts rejects as soon as they are known (--max-rejects)
        self.budget = budget or TokenBudget(cfg.max_batch_tokens, cfg.max_batch_tokens)
        self.online = online
        self.rule = ClosingRule(self.budget, cfg.max_batch_size, cfg.pad_multiple, timeout_ms, max_width)
        self.clock = clock
        self._blocks: list[TokenBlock] = []
        self._rows = 0
        self._longest = 0
        self._oldest_ns: int | None = None
        self._window_id = first_window
        self.windows = 0
        self._batch_id = 0

    def process(self, block: TokenBlock) -> Iterator[Batch]:
        if block.rejects and self.on_rejects is not None:
            self.on_rejects(block.rejects)
        longest = int(block.lengths.max()) if len(block) else 0
        overflows = self.online and self._rows and len(block)
        if overflows and not self.rule.fits(self._rows + len(block), max(self._longest, longest)):
            yield from self._flush()  # the new rows would overflow the batch: close it first
        self._add(block, longest)
        at_edge = (block.first_row + block.input_rows) % self.cfg.sort_window == 0
        if at_edge or (self.online and self._rows and self.rule.full(self._rows, self._longest)):
            yield from self._flush()

    def deadline_ns(self) -> int | None:
        """When the oldest pending row times out; None when nothing waits or there is no timeout."""
        return self.rule.deadline(self._oldest_ns) if self._blocks else None

    def tick(self) -> Iterator[Batch]:
        deadline = self.deadline_ns()
        if deadline is not None and self.clock() >= deadline:
            yield from self._flush()

    def finish(self) -> Iterator[Batch]:
        if self._blocks:
            yield from self._flush()

    def _add(self, block: TokenBlock, longest: int) -> None:
        self._blocks.append(block)
        self._rows += len(block)
        self._longest = max(self._longest, longest)
        if self.rule.timeout_ns is not None:
            arrived = int(block.arrival_ns[0]) if block.arrival_ns is not None and len(block) else self.clock()
            self._oldest_ns = arrived if self._oldest_ns is None else min(self._oldest_ns, arrived)

    def _flush(self) -> Iterator[Batch]:
        blocks, self._blocks = self._blocks, []
        self._rows, self._longest, self._oldest_ns = 0, 0, None
        lengths = np.concatenate([b.lengths for b in blocks])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arrivals = [b.arrival_ns for b in blocks if len(b)]
        window = Window(
            window_id=self._window_id,
            first_row=blocks[0].first_row,
            input_rows=sum(b.input_rows for b in blocks),
            rejects=[r for b in blocks for r in b.rejects],
            rows=np.concatenate([b.rows for b in blocks]),
            sources={b.block_id: b.source for b in blocks},
            file_first_rows={b.block_id: b.file_first_row for b in blocks},
            ids=[i for b in blocks for i in b.ids],
            flat_ids=np.concatenate([b.flat_ids for b in blocks]),
            offsets=offsets,
            block_ids=np.repeat([b.block_id for b in blocks], [len(b) for b in blocks]),
            arrival_ns=np.concatenate(arrivals) if arrivals and all(a is not None for a in arrivals) else None,
            options=[o for b in blocks for o in b.options] if any(b.options is not None for b in blocks) else None,
        )
        self._window_id += 1
        self.windows += 1
        cfg = self.cfg
        held = self.held.get(window.window_id)
        if held is not None and not held.fits(window.first_row, window.input_rows):
            del self.held[window.window_id]  # NOTE: shared: the writer must not fill it in either
            held = None
        window.cut_tokens = held.cut_tokens if held is not None else self.budget.tokens
        cuts = cut_batches(
            lengths, window.cut_tokens, cfg.max_batch_size, cfg.pad_multiple, not self.online, self.max_width
        )
        if held is not None:
            done = np.zeros(len(lengths), dtype=bool)
            done[held.rows] = True
            cuts = [(rows, width) for rows, width in cuts if not done[rows].all()]
        if not cuts:
            cuts = [(np.empty(0, dtype=np.int64), cfg.pad_multiple)]
        window.num_batches = len(cuts)
        closed = self.clock()
        for rows, width in cuts:
            yield Batch(self._batch_id, window, rows, lengths[rows], width, closed)
            self._batch_id += 1
