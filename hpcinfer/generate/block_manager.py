"""The KV cache's bookkeeping: which fixed-size blocks are free and which a sequence owns.

Torch-free. Block ids index the pools in `kv_cache.py`; token i of a sequence lives in block
`block_table[i // block_size]` at offset `i % block_size`.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """A free list over `num_blocks` blocks; a sequence's table grows as its tokens are computed."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain to hold K/V for `num_new_tokens` more computed tokens."""
        total = blocks_for(seq.num_computed + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.needed(seq, num_new_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Appends the blocks `seq` needs; the caller checked `can_grow`."""
        n = self.needed(seq, num_new_tokens)
        if n > len(self._free):
            raise RuntimeError(f"sequence {seq.seq_id} needs {n} blocks, {len(self._free)} are free")
        seq.block_table.extend(self._free.popleft() for _ in range(n))
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, seq: Sequence) -> None:
        """Returns every block of `seq` to the free list (finish or preemption)."""
        self._free.extend(seq.block_table)
        seq.block_table.clear()
