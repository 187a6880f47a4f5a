"""Blocks for a model whose sliding-window layers page their own K/V (pools.py: paged windows).

A sequence holds `block_table` for the full layers and, for each group of sliding-window layers,
`local_tables[j]` beside it, from the same pool. A local block is needed while a query still to
come can see one of its keys: the next query is at position `num_computed` and sees the keys after
`num_computed - window`, and later queries see less. So before each growth the local blocks
behind that are freed (`_slide`), and their places in the tables point at `null`, a zeroed block
nobody is given (the attention paths never read behind a window; a padded read of it weighs 0).
A long answer then holds its window's blocks on those layers, not its whole context.

Prefix caching: a local block is keyed by its full block's key and its group, so a new sequence
takes, with its prefix's full blocks, the cached local blocks of the prefix's last window; where
those were evicted, its hit stops at the longest prefix whose window is still whole (`match`).
"""

from __future__ import annotations

from ..sequence import Sequence
from .block_manager import BlockManager, blocks_for
from .pools import KVLayout


def local_key(key: bytes, group: int) -> bytes:
    """The prefix-cache key of group `group`'s block beside the full block keyed `key`."""
    return key + bytes((group + 1,))


class WindowedBlockManager(BlockManager):
    """`BlockManager` for paged windows: `groups` local tables of `window`-key layers besides the full ones.

    The pool's last block is `null`, never handed out. `peak_full_attention` is the most blocks
    the same sequences would have held with every layer keeping every key (`layers_per_block`:
    the model's layers over a block's), for the report to set beside `peak_used`.
    """

    def __init__(
        self, num_blocks: int, block_size: int, prefix_cache: bool, window: int, groups: int, layers_ratio: float
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"paged windows need at least two blocks (one is the null block), got {num_blocks}")
        super().__init__(num_blocks - 1, block_size, prefix_cache)
        self.null = num_blocks - 1
        self.window = window
        self.groups = groups
        self.layers_ratio = layers_ratio
        self.local_used = 0  # local blocks some sequence holds
        self.peak_full_attention = 0

    @property
    def blocks_per_position(self) -> int:
        return 1 + self.groups

    def _first_seen(self, position: int) -> int:
        """The first block a query at `position`, or any later one, sees on a sliding-window layer."""
        return max(0, position - self.window + 1) // self.block_size

    # --- lookup and admission ---------------------------------------------------------------

    def _window_hits(self, hits: list[int]) -> list[list[int]] | None:
        """The cached local blocks of the last window of the prefix `hits`, per group; None where
        one of them is not cached."""
        first = self._first_seen(len(hits) * self.block_size)
        out: list[list[int]] = [[] for _ in range(self.groups)]
        for block in hits[first:]:
            key = self._key[block]
            assert key is not None, "a prefix hit is a cached block"
            for group, blocks in enumerate(out):
                local = self._cached.get(local_key(key, group))
                if local is None:
                    return None
                blocks.append(local)
        return out

    def _window_pending(self, hits: list[int]) -> bool:
        """Whether every local block of the last window of `hits` is cached or being written this step."""
        for block in hits[self._first_seen(len(hits) * self.block_size) :]:
            key = self._key[block]
            assert key is not None, "a prefix hit is a cached block"
            for group in range(self.groups):
                local = local_key(key, group)
                if local not in self._cached and local not in self._pending:
                    return False
        return True

    def match(self, seq: Sequence) -> tuple[list[int], bool]:
        """The longest cached prefix whose last window is cached on the sliding-window layers too.

        NOTE: where that window's local blocks are being written this step (another sequence
        computes them again), it waits one step for them, as for a pending full block."""
        hits, pending = super().match(seq)
        if hits and self._window_hits(hits) is None and self._window_pending(hits):
            return [], True
        for count in range(len(hits), 0, -1):
            if self._window_hits(hits[:count]) is not None:
                return hits[:count], pending and count == len(hits)
        return [], pending and not hits

    def can_admit(self, hits: list[int], seq: Sequence, num_new_tokens: int) -> bool:
        window = self._window_hits(hits) or []
        taken = sum(1 for b in hits if self.ref[b] == 0) + sum(1 for g in window for b in g if self.ref[b] == 0)
        new = blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(hits)
        return new * self.blocks_per_position <= self.num_free - taken

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        first = self._first_seen(len(hits) * self.block_size)
        window = self._window_hits(hits) if hits else [[] for _ in range(self.groups)]
        assert window is not None, "admit only what match found"
        seq.local_tables = [[self.null] * min(first, len(hits)) + blocks for blocks in window]
        for blocks in window:
            for block in blocks:
                self._take(block)
        seq.window_from = min(first, len(hits))
        super().admit(seq, hits, num_new_tokens)  # NOTE: grows it too (`grow` below)

    # --- growth and release -----------------------------------------------------------------

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        self._slide(seq)
        return self.needed(seq, num_new_tokens) * self.blocks_per_position <= self.num_free

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Frees what the window has left, then appends a full block and a local block per group
        for each new block of positions; keys the local blocks as their full blocks are keyed."""
        if not seq.local_tables:
            seq.local_tables = [[] for _ in range(self.groups)]
        self._slide(seq)
        n = self.needed(seq, num_new_tokens) * self.blocks_per_position
        if n > self.num_free:
            raise RuntimeError(f"sequence {seq.seq_id} needs {n} blocks, {self.num_free} are free")
        keyed = len(seq.block_keys)
        super().grow(seq, num_new_tokens)
        for blocks in seq.local_tables:
            while len(blocks) < len(seq.block_table):
                blocks.append(self._allocate())
                self.local_used += 1
        self._note_peaks()
        for i in range(keyed, len(seq.block_keys)):
            for group, blocks in enumerate(seq.local_tables):
                if blocks[i] != self.null:  # NOTE: keyed a step late (a PENDING token), it may have gone
                    key = local_key(seq.block_keys[i], group)
                    self._planned.append((key, blocks[i]))
                    self._pending.add(key)

    def _slide(self, seq: Sequence) -> None:
        """Frees `seq`'s local blocks that no query to come can see."""
        first = min(self._first_seen(seq.num_computed), len(seq.block_table))
        for i in range(seq.window_from, first):
            for blocks in seq.local_tables:
                self._release(blocks[i])
                blocks[i] = self.null
        seq.window_from = max(seq.window_from, first)

    def fork(self, parent: Sequence, child: Sequence, computed: int) -> list[tuple[int, int]]:
        pairs = super().fork(parent, child, computed)
        full = computed // self.block_size
        child.window_from = min(parent.window_from, full)
        child.local_tables = []
        for blocks in parent.local_tables:
            shared = blocks[:full]
            for block in shared[child.window_from :]:
                self.ref[block] += 1
            own = list(shared)
            if pairs:  # the last, partly filled block: a copy of its own on these layers too
                own.append(self._allocate())
                self.local_used += 1
                pairs.append((blocks[full], own[-1]))
            child.local_tables.append(own)
        self._note_peaks()
        return pairs

    def free(self, seq: Sequence) -> None:
        for blocks in reversed(seq.local_tables):
            for block in reversed(blocks[seq.window_from :]):
                self._release(block)
        seq.local_tables = []
        seq.window_from = 0
        super().free(seq)

    def _take(self, block: int) -> None:
        """A cached local block joins a sequence's table."""
        if self.ref[block] == 0:
            del self._evictable[block]
            self.local_used += 1
        self.ref[block] += 1

    def _release(self, block: int) -> None:
        """A sequence lets go of a local block: free once nobody holds it (still findable if keyed)."""
        self.ref[block] -= 1
        if self.ref[block] > 0:
            return
        self.local_used -= 1
        if self._key[block] is not None:
            self._evictable[block] = None
        else:
            self._empty.append(block)

    def _note_peaks(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)
        full = self.num_used - self.local_used
        self.peak_full_attention = max(self.peak_full_attention, round(full * self.layers_ratio))


def block_manager(layout: KVLayout, num_blocks: int, prefix_cache: bool) -> BlockManager | WindowedBlockManager:
    """The block manager a pool of `num_blocks` blocks of this layout needs."""
    if not layout.paged_windows:
        return BlockManager(num_blocks, layout.block_size, prefix_cache)
    ratio = layout.num_layers / layout.block_layers
    return WindowedBlockManager(num_blocks, layout.block_size, prefix_cache, layout.window, layout.local_groups, ratio)


WINDOW_CHUNK = 2048  # the most prompt tokens a paged-window sequence computes a step, or its window


def window_chunk(layout: KVLayout, budget: int) -> int | None:
    """The prefill chunk bound of a sequence with paged windows (scheduler `max_chunk`), None without:
    the step budget up to the window or WINDOW_CHUNK, whichever is larger (the default budget's)."""
    return min(budget, max(layout.window, WINDOW_CHUNK)) if layout.paged_windows else None


def longest_sequence(layout: KVLayout, num_blocks: int, chunk: int | None) -> int:
    """The most tokens one sequence can always hold in `num_blocks` blocks, everything else preempted.

    With paged windows it holds a full block for each block of positions, and per group of
    sliding-window layers the blocks of its window and of the chunk being computed (at most
    `chunk` tokens; None: a whole prompt at once, no chunked prefill), never more than its positions'."""
    bs = layout.block_size
    if not layout.paged_windows:
        return num_blocks * bs
    usable = num_blocks - 1  # the null block is nobody's
    groups, window = layout.local_groups, blocks_for(layout.window, bs) + 1

    def need(tokens: int) -> int:
        positions = blocks_for(tokens, bs)
        computing = blocks_for(tokens if chunk is None else min(chunk, tokens), bs)
        return positions + groups * min(positions, window + computing)

    lo, hi = 0, usable  # in blocks of positions: need() grows with them
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid * bs) <= usable else (lo, mid - 1)
    return lo * bs
