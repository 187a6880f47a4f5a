"""Paged windows: a sliding-window layer's blocks are freed once every window has left them.

The block manager as tables (what a long answer holds, what a prefix hit takes, what a fork
shares); then the engine on a tiny Gemma 2 (a window of 12 keys, blocks of 4) gives the same
tokens with its windows paged as with every layer keeping every key (that path is held to
transformers in test_decoder_families.py): plain, chunked, preempted, prefix-cached, n=2 forks,
beams, speculation (the Triton kernel and flash-attn's call on paged windows:
test_generate_attention.py); blocks freed behind a window are poisoned at once, so a read of one
would change the answers; and a long answer holds a fraction of the blocks full attention would.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.kvcache.block_manager import blocks_for
from hpcinfer.engine.kvcache.pools import KVLayout, can_page_windows
from hpcinfer.engine.kvcache.windowed_blocks import WindowedBlockManager, local_key, longest_sequence, window_chunk
from hpcinfer.engine.scheduler import Scheduler
from hpcinfer.engine.sequence import SamplingParams, Sequence
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from tests.fixtures.tiny_decoder import build_tiny_decoder

BS, WINDOW = 4, 12

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def manager(num_blocks: int = 64, prefix_cache: bool = False, groups: int = 1) -> WindowedBlockManager:
    return WindowedBlockManager(num_blocks, BS, prefix_cache, WINDOW, groups, layers_ratio=2.0)


def steps(sched: Scheduler, n: int) -> None:
    for _ in range(n):
        plan = sched.schedule()
        sched.update(plan, [7] * sum(c.samples for c in plan.chunks))


def live(seq: Sequence, null: int) -> list[int]:
    return [i for i, b in enumerate(seq.local_tables[0]) if b != null]


# --- the block manager as tables --------------------------------------------------------------


def test_a_long_answer_holds_its_window_on_the_sliding_layers_and_all_of_it_on_the_full_ones():
    blocks = manager(groups=2)
    sched = Scheduler(blocks, 4, 64)
    seq = Sequence(0, list(range(10)), SamplingParams(max_tokens=100))
    sched.add(seq)
    steps(sched, 31)  # 10 prompt tokens, then 30 decodes: 40 tokens computed
    assert seq.num_computed == 40 and len(seq.block_table) == 10
    # the next query, at position 40, sees keys 29..40: from block 7 (block 7 holds 28..31)
    first = (40 - WINDOW + 1) // BS
    for table in seq.local_tables:
        assert [b for b in table[:first] if b != blocks.null] == []
        assert blocks.null not in table[first:]
    assert live(seq, blocks.null) == list(range(first, 10))
    held = len(seq.block_table) + 2 * len(live(seq, blocks.null))
    assert blocks.num_used == held
    assert blocks.peak_full_attention == round(len(seq.block_table) * 2.0)
    sched.finish(seq, "stop")
    assert blocks.num_used == 0 and blocks.local_used == 0


def test_a_prefix_hit_takes_the_cached_window_and_stops_where_the_window_was_evicted():
    blocks = manager(prefix_cache=True)
    sched = Scheduler(blocks, 4, 64)
    first = Sequence(0, list(range(30)), SamplingParams(max_tokens=20))
    sched.add(first)
    steps(sched, 12)  # 30 prompt tokens, then 11 decodes: its window has left blocks 0..5
    assert live(first, blocks.null)[0] >= 6
    # a prompt sharing the first 28 tokens: 7 full blocks; the window of position 28 is blocks 4..6
    second = Sequence(1, list(range(28)) + [99, 98], SamplingParams(max_tokens=1))
    hits, _ = blocks.match(second)
    window_cached = all(blocks.cached_block(local_key(blocks._key[b], 0)) is not None for b in hits[4:7])
    assert window_cached  # freed behind the first one's window, but still cached
    assert hits == first.block_table[:7]
    sched.add(second)
    steps(sched, 1)
    assert second.num_computed == 30 and second.local_tables[0][:4] == [blocks.null] * 4
    assert second.local_tables[0][4:7] == [blocks.cached_block(local_key(blocks._key[b], 0)) for b in hits[4:7]]
    # evict the local block of block 5 (as a full pool would): the hit stops where a window is whole
    victim = blocks.cached_block(local_key(blocks._key[hits[5]], 0))
    sched.finish(second, "stop")
    del blocks._cached[blocks._key[victim]]
    blocks._key[victim] = None
    third = Sequence(2, list(range(28)) + [97], SamplingParams(max_tokens=1))
    hits, _ = blocks.match(third)
    # a hit of h blocks needs the window of position 4h: blocks (4h - 11) // 4 .. h - 1, none of them 5
    assert len(hits) == 5 and (4 * 5 - WINDOW + 1) // BS == 2
    # the third computes blocks 5 and 6 again; a fourth of the same prefix in that step waits for them
    fourth = Sequence(3, list(range(28)) + [96], SamplingParams(max_tokens=1))
    sched.add(third)
    sched.add(fourth)
    steps(sched, 1)
    assert third.num_cached == 20 and fourth in sched.waiting  # 20: the 5 blocks whose window is whole
    steps(sched, 1)
    assert fourth.num_cached == 28  # all 7 blocks, the window's local ones written by the third


def test_a_fork_shares_the_window_and_copies_its_partly_filled_block_on_every_table():
    blocks = manager(groups=2)
    sched = Scheduler(blocks, 4, 64)
    parent = Sequence(0, list(range(22)), SamplingParams(max_tokens=5))
    sched.add(parent)
    steps(sched, 1)
    child = Sequence(0, list(range(22)), SamplingParams(max_tokens=5))
    pairs = blocks.fork(parent, child, 22)
    assert pairs == [(parent.block_table[5], child.block_table[5])] + [
        (table[5], child_table[5]) for table, child_table in zip(parent.local_tables, child.local_tables, strict=True)
    ]
    assert child.window_from == parent.window_from
    for table, child_table in zip(parent.local_tables, child.local_tables, strict=True):
        assert child_table[:5] == table[:5]
        assert all(blocks.ref[b] == 2 for b in table[parent.window_from : 5])
    blocks.free(child)
    blocks.free(parent)
    assert blocks.num_used == 0


def test_one_sequence_always_fits_the_pool_it_is_sized_for():
    layout = KVLayout(4, 2, 16, BS, torch.float32, windows=(WINDOW, 0, WINDOW, WINDOW), paged_windows=True)
    assert layout.block_layers == 1 and layout.local_groups == 3
    assert layout.places == ((0, 0), (0, -1), (0, 1), (0, 2))
    for chunk in (8, None):
        longest = longest_sequence(layout, 80, chunk)
        blocks = WindowedBlockManager(80, BS, False, WINDOW, 3, 4.0)
        sched = Scheduler(blocks, 4, chunk or 1000, chunked_prefill=chunk is not None)
        seq = Sequence(0, list(range(longest - 1)), SamplingParams(max_tokens=1, ignore_eos=True))
        sched.add(seq)
        while seq.num_computed < longest:  # its prompt, then decodes up to the longest it may be
            steps(sched, 1)
        assert sched.preemptions == 0 and len(seq.block_table) == longest // BS, chunk
        assert longest > 40 * BS if chunk else longest > 15 * BS  # most of the pool, not a token-sized bound
    assert not can_page_windows((WINDOW, 8, 0)) and not can_page_windows((WINDOW, WINDOW))


# --- the engine: the same tokens as every layer keeping every key ----------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory, one_torch_thread):
    # NOTE: a byte-level vocabulary of 268 tokens (the prompts' ids are below 250): the logits and
    # the draws of every step over it, where a 30,522-token one made them a third of these tests' time
    path = build_tiny_decoder(
        tmp_path_factory.mktemp("gemma2"), "Gemma2ForCausalLM", seed=5, max_positions=1024, byte_level=True,
        layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
    )  # fmt: skip
    return load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 5-60 tokens, half of them after one of two shared 30-token system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(5, 250) for _ in range(30)] for _ in range(2)]
    out = [[rng.randrange(5, 250) for _ in range(rng.randint(5, 60))] for _ in range(n)]
    return [systems[i % 2] + p if i % 2 else p for i, p in enumerate(out)]


def answers(model, prompts, params, **cfg) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, EngineConfig(**{"block_size": BS, **cfg}), eos_token_ids=())
    return [s.completion for s in engine.generate(prompts, params)], engine


def kv_bytes(model, blocks: int) -> int:
    return blocks * KVLayout.of(model.cfg, BS, torch.float32).bytes_per_block


SEEDED = [SamplingParams(max_tokens=40, temperature=0.9, seed=s, ignore_eos=True) for s in range(3)]
CONFIGS = {
    "plain": {"max_num_batched_tokens": 512, "max_num_seqs": 16},
    "chunked": {"max_num_batched_tokens": 24, "max_num_seqs": 8},
    "preempted": {"max_num_batched_tokens": 64, "max_num_seqs": 8, "pool_blocks": 60},
    "no prefix cache": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "prefix_cache": False},
    "speculation": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "speculative_tokens": 3},
    "fp8 cache": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "kv_storage": torch.float8_e4m3fn},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_windows_give_the_tokens_of_every_layer_keeping_every_key(model, name):
    cfg = dict(CONFIGS[name])
    if "pool_blocks" in cfg:  # blocks of every layer; the paged pool has the same bytes
        cfg["kv_cache_memory"] = kv_bytes(model, cfg.pop("pool_blocks"))
    given = prompts(24)
    params = [SEEDED[i % 3] for i in range(len(given))]
    if name == "speculation":  # prompt lookup proposes from repeats: answers that repeat their prompt
        given = [p + p[:20] for p in given]
        params = [SamplingParams(max_tokens=40, ignore_eos=True)] * len(given)
    want, whole = answers(model, given, params, page_windows=False, **cfg)
    got, paged = answers(model, given, params, **cfg)
    assert type(paged.blocks) is WindowedBlockManager and paged.cache.layout.block_layers == 2
    assert got == want
    assert sum(map(len, got)) == 40 * len(given)
    if name == "preempted":
        assert whole.stats.preemptions > 0
    if name == "plain":
        assert paged.stats.cached_tokens > 0
    assert paged.stats.peak_blocks_full_attention > 1.4 * paged.stats.peak_blocks


def test_n_samples_and_beams_fork_the_same_with_paged_windows(model):
    given = prompts(6, seed=2)
    n2 = SamplingParams(max_tokens=30, temperature=1.0, seed=3, n=2, ignore_eos=True)
    beams = SamplingParams(max_tokens=20, beam_width=3, ignore_eos=True)
    for params in (n2, beams):
        engines = {}
        for paged in (False, True):
            engine = Engine(model, EngineConfig(block_size=BS, page_windows=paged), eos_token_ids=())
            engines[paged] = [(s.completion, s.sample_index) for s in engine.generate(given, params)]
        assert engines[True] == engines[False]


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_blocks_freed_behind_a_window_are_never_read_and_writes_land_in_blocks_of_their_own(model, prefix_cache):
    """Each local block is poisoned the moment the last sequence lets go of it (unless the prefix
    cache keeps it, for a later prompt whose window it is in), and each fresh block as it is handed
    out: a read behind a window, or of a block another sequence now holds, would change the
    answers. Every write lands in a block one sequence holds, registered under no key."""
    given = prompts(24, seed=4)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    cfg = {"max_num_batched_tokens": 48, "max_num_seqs": 8, "kv_cache_memory": kv_bytes(model, 60),
           "prefix_cache": prefix_cache}  # fmt: skip
    want, _ = answers(model, given, params, page_windows=False, **cfg)
    engine = Engine(model, EngineConfig(block_size=BS, **cfg), eos_token_ids=())
    blocks, cache = engine.blocks, engine.cache
    take, release, write = blocks._allocate, blocks._release, cache.write
    freed: list[int] = []

    def poison(block: int) -> None:
        cache.k[:, block] = 1e3  # finite: a read of it weighs in, where it should not be read at all
        cache.v[:, block] = -1e3

    def poisoned_allocate() -> int:
        block = take()
        poison(block)
        return block

    def poisoned_release(block: int) -> None:
        release(block)
        if blocks.ref[block] == 0 and blocks._key[block] is None:
            poison(block)
            freed.append(block)

    def guarded_write(layer, slots, k, v):
        for block in {int(s) // BS for s in slots}:
            assert blocks.ref[block] == 1 and blocks._key[block] is None, f"write into shared block {block}"
        write(layer, slots, k, v)

    blocks._allocate, blocks._release = poisoned_allocate, poisoned_release  # type: ignore[method-assign]
    cache.write = guarded_write  # type: ignore[method-assign]
    got = [s.completion for s in engine.generate(given, params)]
    assert got == want
    assert len(freed) > (20 if prefix_cache else 100) and engine.stats.preemptions > 0
    assert engine.stats.cached_tokens > 0 if prefix_cache else not any(k is not None for k in blocks._key)


def test_a_long_answer_holds_a_fraction_of_what_full_attention_would():
    """The measurement the report carries: one 400-token answer on 4 layers, 2 of them sliding
    with a 12-key window, holds its 2 full layers' context and the sliding ones' window."""
    blocks = manager(num_blocks=400, groups=1)
    sched = Scheduler(blocks, 4, 64)
    seq = Sequence(0, list(range(10)), SamplingParams(max_tokens=400, ignore_eos=True))
    sched.add(seq)
    steps(sched, 391)
    full = blocks_for(400, BS)
    assert blocks.peak_full_attention == 2 * full
    assert blocks.peak_used <= full + blocks_for(WINDOW, BS) + 2


def test_a_reset_engine_keeps_its_pool_and_its_null_block(model):
    """After a device fault the engine drops its sequences and starts its books again, on the same pool."""
    engine = Engine(model, EngineConfig(block_size=BS, kv_cache_memory=kv_bytes(model, 60)), eos_token_ids=())
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    first = [s.completion for s in engine.generate(prompts(4), params)]
    before = (engine.blocks.num_blocks, engine.blocks.null)
    engine.reset()
    assert (engine.blocks.num_blocks, engine.blocks.null) == before == (engine.cache.num_blocks - 1,) * 2
    assert [s.completion for s in engine.generate(prompts(4), params)] == first


def test_a_pool_too_small_for_one_sequence_and_its_windows_is_one_line(model):
    from hpcinfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--kv-cache-memory: a pool of \d+ blocks cannot hold one sequence"):
        Engine(model, EngineConfig(block_size=BS, kv_cache_memory=kv_bytes(model, 1)), eos_token_ids=())


def test_a_larger_step_budget_does_not_shorten_the_longest_context():
    """A sequence's prefill chunk is bounded (the window, or 2,048 tokens) where windows are paged,
    so a larger --max-num-batched-tokens keeps the longest context a pool holds."""
    layout = KVLayout(4, 2, 16, BS, torch.float32, windows=(WINDOW, 0, WINDOW, WINDOW), paged_windows=True)
    assert window_chunk(layout, 8192) == window_chunk(layout, 2048) == 2048 and window_chunk(layout, 512) == 512
    bounded = longest_sequence(layout, 6000, window_chunk(layout, 8192))
    assert bounded == longest_sequence(layout, 6000, 2048) > longest_sequence(layout, 6000, 8192)
    assert window_chunk(replace(layout, paged_windows=False), 8192) is None
    blocks = WindowedBlockManager(6000, BS, False, WINDOW, 3, 4.0)
    sched = Scheduler(blocks, 4, 8192, max_chunk=window_chunk(layout, 8192))
    seq = Sequence(0, list(range(3000)), SamplingParams(max_tokens=1))
    sched.add(seq)
    plan = sched.schedule()
    assert [(c.start, c.length) for c in plan.prefills] == [(0, 2048)]
