"""A draft model's proposals (`--speculative draft:MODEL`): a small decoder of the same tokenizer
guesses each speculating sequence's next k tokens, greedily, and the model verifies them in one
forward as it verifies prompt-lookup proposals (speculate.py: the same acceptance, so greedy
answers stay token for token the same, and a sampled answer keeps each proposal with the model's
own probability of it, speculative sampling's rule for a proposal the draft chose outright).

The draft keeps a shadow of each speculating sequence with a paged KV cache of its own (one
sequence's longest context for each of the few sequences that may speculate at once). Before
proposing, a shadow is cut back to what it shares with its sequence (the proposals the model
refused are forgotten), catches up on the tokens it has not computed (a prompt's first time: the
whole prompt, in chunks of the step's token budget), then runs one decode step per proposal for
all the shadows together. A shadow whose sequence stops speculating is dropped.

Its cache shares prefixes as the model's does (block_manager.py): a new shadow takes the blocks of
its longest prefix another shadow computed (a batch's common system prompt is prefilled by the
draft once, not once per answer). Only full blocks of the sequence's own tokens are ever shared:
proposals never fill the block they start in (speculate.room), so a block holding a guess the
model refused is never findable.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from ..device import accelerators
from ..models.llama import LlamaDecoder
from .kvcache.block_manager import BlockManager, blocks_for
from .kvcache.pools import KVCache, KVLayout
from .runner import ModelRunner
from .sample.sampling import greedy
from .scheduler import Chunk, StepPlan
from .sequence import SamplingParams, Sequence


class DraftModel:
    """A small decoder proposing tokens for up to `most_seqs` sequences at a time."""

    def __init__(
        self, model: LlamaDecoder, block_size: int, max_model_len: int, budget: int, most_seqs: int, vocab: int
    ) -> None:
        """`max_model_len`: the engine's context (the draft proposes within its own, if shorter);
        `budget`: the most tokens a draft forward takes; `vocab`: the model's vocabulary (a draft's
        padded rows beyond it are never proposed)."""
        device = model.norm.device
        self.max_model_len = min(max_model_len, model.cfg.max_model_len)
        layout = KVLayout.of(model.cfg, block_size, model.norm.dtype, None)
        num_blocks = most_seqs * blocks_for(self.max_model_len, block_size)
        if device.type == "cuda":  # NOTE: beside the model's pool, which took its share: a tenth of what is left
            num_blocks = max(1, min(num_blocks, int(accelerators.free_bytes(device) * 0.1) // layout.bytes_per_block))
        self.cache = KVCache(layout, num_blocks, device)
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache=True)
        self.cache.writer = self.blocks
        self.runner = ModelRunner(model, self.cache, budget, most_seqs, self.max_model_len)
        self.budget, self.vocab = budget, vocab
        self.shadows: dict[int, Sequence] = {}  # by the id of the sequence each follows
        self.forwards = 0
        self.computed = self.cached = 0  # tokens the draft ran, and tokens new shadows took from its cache

    def propose(self, seqs: Seq[Sequence], rooms: Seq[int], keep: Seq[Sequence] = ()) -> list[list[int]]:
        """Up to `rooms[i]` proposals for each of `seqs` (fewer near the draft's own context end, none
        where its pool has no room); `keep`: sequences whose shadows stay though they propose nothing
        this step (the running ones: their K/V saves a catch-up later)."""
        self._drop_others([*seqs, *keep])
        want: dict[int, int] = {}
        reserved = 0  # blocks the shadows taken so far will grow by
        for seq, room in zip(seqs, rooms, strict=True):
            room = min(room, self.max_model_len - seq.num_tokens - 1)
            if room <= 0:
                continue
            self._follow(seq)  # NOTE: may take cached blocks that counted as free: the pool read after it
            shadow = self.shadows[id(seq)]
            needed = self.blocks.needed(shadow, seq.num_tokens + room - shadow.num_computed)
            if needed > self.blocks.num_free - reserved:
                self.blocks.free(self.shadows.pop(id(seq)))  # NOTE: the pool is full: this one proposes nothing
                continue
            reserved += needed
            want[id(seq)] = room
        got: dict[int, list[int]] = {key: [] for key in want}
        owner = {id(self.shadows[key]): key for key in want}
        while any(len(got[key]) < n for key, n in want.items()):
            plan, budget = StepPlan(), self.budget
            for key in (k for k, n in want.items() if len(got[k]) < n):
                shadow = self.shadows[key]
                n = min(shadow.num_tokens - shadow.num_computed, budget)
                if n == 0:
                    break
                self.blocks.grow(shadow, n)
                chunk = Chunk(shadow, shadow.num_computed, n)
                (plan.decodes if n == 1 and shadow.num_computed > 0 else plan.prefills).append(chunk)
                budget -= n
            try:
                logits = self.runner.run(plan)
            except BaseException:
                self.blocks.abort([c.seq for c in plan.chunks])  # NOTE: nothing it planned to fill was written
                raise
            self.blocks.commit()
            self.forwards += 1
            self.computed += plan.num_tokens
            chosen = iter(greedy(logits[:, : self.vocab]).tolist())
            for chunk in plan.chunks:
                chunk.seq.num_computed += chunk.length
                if chunk.samples:
                    token = next(chosen)
                    chunk.seq.tokens.append(token)
                    got[owner[id(chunk.seq)]].append(token)
        return [got.get(id(seq), []) for seq in seqs]

    def _follow(self, seq: Sequence) -> None:
        """The shadow of `seq`, holding its tokens, its K/V kept for the tokens they still share."""
        shadow = self.shadows.get(id(seq))
        if shadow is None:
            shadow = self.shadows[id(seq)] = Sequence(seq.seq_id, list(seq.tokens), SamplingParams())
            hits, _ = self.blocks.match(shadow)
            if hits and self.blocks.can_admit(hits, shadow, 0):
                self.blocks.admit(shadow, hits, 0)
                self.cached += shadow.num_computed
        shared, limit = 0, min(shadow.num_computed, seq.num_tokens - 1)  # NOTE: the last token runs again
        while shared < limit and shadow.tokens[shared] == seq.tokens[shared]:
            shared += 1
        shadow.tokens = list(seq.tokens)
        shadow.num_computed = shared

    def _drop_others(self, seqs: Seq[Sequence]) -> None:
        keep = {id(seq) for seq in seqs}
        for key in [k for k in self.shadows if k not in keep]:
            self.blocks.free(self.shadows.pop(key))

    def reset(self) -> None:
        """Forgets every shadow (the engine dropped its sequences)."""
        self._drop_others(())
