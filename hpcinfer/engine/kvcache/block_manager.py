"""The KV cache's bookkeeping: which fixed-size blocks are free, which a sequence owns, which are cached.

Torch-free. Block ids index the pools in `kv_cache.py`; token i of a sequence lives in block
`block_table[i // block_size]` at offset `i % block_size`.

Prefix caching (on with `prefix_cache=True`): a FULL block is keyed by hash(parent block's key,
its tokens), so a key names the whole prefix up to the block's end. A new sequence takes, by
reference, every cached block of its longest cached prefix and computes only the rest.
NOTE: the invariants that keep shared blocks read-only:
- a block is registered (findable by key) only after the step that wrote it (`commit`), and a
  sequence computes from the end of its cached prefix, in blocks of its own; so a registered
  block, however many sequences share it, is never written again;
- a block nobody holds but that is registered stays cached, in least-recently-freed order,
  until the allocator needs it (`_allocate` evicts from the front);
- a sequence's blocks are freed tail first, so a prefix's deeper blocks are evicted before the
  blocks they hang from (a child without its parent could never be found).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ..sequence import PENDING, Sequence

ROOT = b""  # the parent key of a sequence's first block


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_key(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The key of a full block: 128 bits of hash(parent key, token ids); collisions are negligible."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_of(lora: int, media: Any = None) -> bytes:
    """The parent key of a sequence's first block: a LoRA adapter's K/V are its own, never shared
    with the base's; a prompt with images keys by their digest (models.vlm.Media), so the same
    image's prompts share blocks and two images never do."""
    root = ROOT if not lora else b"lora:%d" % lora
    return root if media is None else root + b"media:" + media.digest


def prefix_keys(tokens: list[int], block_size: int, limit: int | None = None, root: bytes = ROOT) -> list[bytes]:
    """Keys of the full blocks of `tokens[:limit]`, chained from `root`."""
    keys: list[bytes] = []
    parent = root
    end = len(tokens) if limit is None else limit
    for start in range(0, end - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


class BlockManager:
    """Free blocks, per-block reference counts and, with `prefix_cache`, the key -> block map."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks  # the key a block is registered under
        # free and holding nothing worth keeping, the next one to hand out last. NOTE: last in, first
        # out: a block just freed is handed out again before one never written, so a long job keeps
        # writing the pages it has touched (resident, in cache) instead of sweeping the whole pool,
        # each of its pages faulted in on first write (blocks never used are never touched)
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached: least recently freed first
        self._cached: dict[bytes, int] = {}
        self._planned: list[tuple[bytes, int]] = []  # full blocks being written this step
        self._pending: set[bytes] = set()
        self.peak_used = 0
        self.peak_full_attention = 0  # what the same sequences would hold if every layer kept every key
        self.high_water = 0  # blocks [0, high_water) have been handed out at least once (written)
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_block(self, key: bytes) -> int | None:
        return self._cached.get(key)

    # --- lookup and admission ---------------------------------------------------------------

    def match(self, seq: Sequence) -> tuple[list[int], bool]:
        """The cached blocks of `seq`'s longest cached prefix, and whether the next block is pending.

        NOTE: at least the last token is left to compute, so the step that admits `seq` has its
        logits to sample from. "Pending" means another sequence writes that block in this step:
        waiting one step for it beats computing it twice.
        """
        if not self.prefix_cache or seq.block_table or seq.params.prompt_logprobs is not None:
            return [], False  # NOTE: prompt log-probabilities need every prompt token's logits
        keys = prefix_keys(seq.tokens, self.block_size, seq.num_tokens - 1, root_of(seq.params.lora, seq.params.media))
        hits: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                return hits, key in self._pending
            hits.append(block)
        return hits, False

    def can_admit(self, hits: list[int], seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq` can take `hits` and grow by `num_new_tokens` after them."""
        taken = sum(1 for b in hits if self.ref[b] == 0)  # cached but free: leaving the free pool
        new = blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(hits)
        return new <= self.num_free - taken

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Gives `seq` the cached blocks `hits` (it skips their tokens), then grows it by `num_new_tokens`."""
        for block in hits:
            if self.ref[block] == 0:
                del self._evictable[block]
            self.ref[block] += 1
            seq.block_keys.append(self._key[block])  # type: ignore[arg-type]
        seq.block_table.extend(hits)
        seq.num_computed = len(hits) * self.block_size
        self.grow(seq, num_new_tokens)

    # --- growth and release -----------------------------------------------------------------

    def needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain to hold K/V for `num_new_tokens` more computed tokens."""
        total = blocks_for(seq.num_computed + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.needed(seq, num_new_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Appends the blocks `seq` needs; the caller checked `can_grow`.

        With prefix caching the blocks this growth fills get their keys now (the tokens are
        known) and become findable once the step has written them (`commit`). NOTE: a block that
        holds a PENDING token (sampled, not yet read back) gets its key at a later growth, once
        the token is known; the blocks after it wait too, since a key names its parent.
        """
        n = self.needed(seq, num_new_tokens)
        if n > self.num_free:
            raise RuntimeError(f"sequence {seq.seq_id} needs {n} blocks, {self.num_free} are free")
        seq.block_table.extend(self._allocate() for _ in range(n))
        self._note_peaks()
        if not self.prefix_cache:
            return
        bs, full = self.block_size, (seq.num_computed + num_new_tokens) // self.block_size
        for i in range(len(seq.block_keys), full):
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            if PENDING in tokens:
                break
            parent = seq.block_keys[-1] if seq.block_keys else root_of(seq.params.lora, seq.params.media)
            key = block_key(parent, tokens)
            seq.block_keys.append(key)
            self._planned.append((key, seq.block_table[i]))
            self._pending.add(key)

    @property
    def blocks_per_position(self) -> int:
        """Blocks a sequence takes for each new block of positions (windowed_blocks.py: more)."""
        return 1

    def fork(self, parent: Sequence, child: Sequence, computed: int) -> list[tuple[int, int]]:
        """Gives `child` the blocks of `parent`'s first `computed` tokens: its full blocks by
        reference, and a block of its own for the last, partly filled one, returned as [(parent's
        block, child's block)] for the caller to copy ([] when none is partly filled). The caller
        checked `can_fork`."""
        full = computed // self.block_size
        shared = parent.block_table[:full]
        for block in shared:
            self.ref[block] += 1
        child.block_table = list(shared)
        child.block_keys = list(parent.block_keys[:full])
        if computed == full * self.block_size:
            return []
        own = self._allocate()
        child.block_table.append(own)
        self._note_peaks()
        return [(parent.block_table[full], own)]

    def can_fork(self, parent: Sequence, computed: int, children: int) -> bool:
        return children * (computed % self.block_size > 0) * self.blocks_per_position <= self.num_free

    def commit(self) -> None:
        """The step ran: the full blocks it wrote become findable (the first writer of a key wins)."""
        for key, block in self._planned:
            if key not in self._cached and self.ref[block] > 0:
                self._cached[key] = block
                self._key[block] = key
        self._planned.clear()
        self._pending.clear()

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """The step did not run: the blocks it planned to fill stay unfindable, and its sequences
        forget their keys (named again when the blocks are filled, at a later growth)."""
        planned = {key for key, _ in self._planned}
        for seq in seqs:
            while seq.block_keys and seq.block_keys[-1] in planned:
                seq.block_keys.pop()
        self._planned.clear()
        self._pending.clear()

    def free(self, seq: Sequence) -> None:
        """Releases every block of `seq` (finish or preemption); cached ones stay findable."""
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            if self.ref[block] > 0:
                continue
            if self._key[block] is not None:
                self._evictable[block] = None
            else:
                self._empty.append(block)
        seq.block_table.clear()
        seq.block_keys.clear()

    def _note_peaks(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)
        self.peak_full_attention = self.peak_used

    def _allocate(self) -> int:
        """A block for new K/V: an empty one, else the least recently freed cached one (evicted)."""
        if self._empty:
            block = self._empty.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._key[block]]  # type: ignore[arg-type]
            self._key[block] = None
            self.evictions += 1
        self.ref[block] = 1
        if block >= self.high_water:
            self.high_water = block + 1
        return block


def max_hit_rate(prompts: Iterable[list[int]], block_size: int) -> float:
    """The best prefix-cache hit rate for these prompts: an unbounded cache, every block computed once.

    A prompt can take from the cache the full blocks before its last token; each distinct block
    (a distinct key: a distinct prefix) must still be computed by the first prompt that has it.
    """
    total = cacheable = 0
    seen: set[bytes] = set()
    for tokens in prompts:
        total += len(tokens)
        keys = prefix_keys(tokens, block_size, len(tokens) - 1)
        cacheable += block_size * sum(1 for k in keys if k in seen)
        seen.update(keys)
    return cacheable / total if total else 0.0
