"""Prefix caching: the block manager's key chain, reference counts and LRU as tables; the engine's
output with the cache equal to without it (greedy, seeded, chunked, preempted); shared blocks
never written; the hit rate of a constructed input equal to the theoretical one."""

from __future__ import annotations

import random

import pytest
import torch

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.kvcache.block_manager import ROOT, BlockManager, block_key, max_hit_rate, prefix_keys
from hpcinfer.engine.kvcache.pools import KVLayout
from hpcinfer.engine.scheduler import Scheduler
from hpcinfer.engine.sequence import SamplingParams, Sequence
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from tests.fixtures.tiny_decoder import build_tiny_decoder

BS = 4


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, list(tokens), SamplingParams())


def run_step(sched: Scheduler) -> list[tuple[int, int, int]]:
    plan = sched.schedule()
    sched.update(plan, [7] * sum(c.samples for c in plan.chunks))
    return [(c.seq.seq_id, c.start, c.length) for c in plan.prefills]


# --- the block manager as tables --------------------------------------------------------------


def test_a_key_names_the_whole_prefix_not_just_the_block():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = prefix_keys([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(b) == 2  # only full blocks have keys
    assert a[0] == block_key(ROOT, [1, 2, 3, 4]) and a[1] == block_key(a[0], [5, 6, 7, 8])
    assert a[1] != b[1]  # same tokens, different parent
    assert prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], BS, limit=7) == a[:1]


@pytest.mark.parametrize(
    ("second", "expected_start", "shared"),
    [
        # same 8-token prefix, longer: both blocks shared, computes from 8
        (list(range(8)) + [50, 51], 8, 2),
        # identical 8-token prompt: the last token is recomputed, so only block 0 is shared
        (list(range(8)), 4, 1),
        # differs in block 1: block 0 shared
        ([0, 1, 2, 3, 9, 9, 9, 9, 9], 4, 1),
        # differs at token 0: nothing shared
        ([5, 1, 2, 3, 4, 5, 6, 7, 8], 0, 0),
    ],
)
def test_a_new_sequence_takes_its_longest_cached_prefix(second, expected_start, shared):
    blocks = BlockManager(16, BS, prefix_cache=True)
    sched = Scheduler(blocks, 8, 64)
    first = seq(0, list(range(9)))
    sched.add(first)
    assert run_step(sched) == [(0, 0, 9)]
    other = seq(1, second)
    sched.add(other)
    assert run_step(sched) == [(1, expected_start, len(second) - expected_start)]
    assert other.block_table[:shared] == first.block_table[:shared]
    assert other.num_cached == expected_start and sched.cached_tokens == expected_start
    assert [blocks.ref[b] for b in first.block_table] == [2] * shared + [1] * (3 - shared)


def test_refcounts_fall_and_freed_cached_blocks_stay_findable():
    blocks = BlockManager(8, BS, prefix_cache=True)
    sched = Scheduler(blocks, 8, 64)
    a, b = seq(0, list(range(10))), seq(1, list(range(8)) + [60, 61])
    sched.add(a)
    run_step(sched)
    sched.add(b)
    run_step(sched)
    shared = a.block_table[:2]
    sched.finish(a, "stop")
    assert [blocks.ref[x] for x in shared] == [1, 1] and blocks.num_used == 3  # b: 2 shared + its tail
    sched.finish(b, "stop")
    assert blocks.num_free == 8 and blocks.num_cached == 2  # a's block 2 had 2 tokens: never full, never keyed
    c = seq(2, list(range(8)) + [70])
    sched.add(c)
    assert run_step(sched) == [(2, 8, 1)] and c.block_table[:2] == shared


def test_eviction_takes_empty_blocks_first_then_the_least_recently_freed():
    blocks = BlockManager(4, BS, prefix_cache=True)
    sched = Scheduler(blocks, 8, 64)
    a, b = seq(0, [1] * 8 + [0]), seq(1, [2] * 4 + [0])
    sched.add(a)
    run_step(sched)
    assert a.block_table == [0, 1, 2]  # blocks 0, 1 full (keyed), 2 holds the tail
    sched.finish(a, "stop")  # tail first: 2 -> empty; 1, then 0 -> cached, least recent first
    sched.add(b)
    run_step(sched)
    # empty blocks first, the one freed last first (its pages are touched): a's cached ones survive
    assert b.block_table == [2, 3]
    sched.finish(b, "stop")  # 3 -> empty; 2 -> cached, after 1 and 0
    assert blocks.num_cached == 3 and blocks.num_free == 4
    a_keys = prefix_keys([1] * 8, BS)
    assert blocks._allocate() == 3 and blocks.evictions == 0
    assert blocks._allocate() == 1 and blocks.cached_block(a_keys[1]) is None  # a's deeper block goes first
    assert blocks.cached_block(a_keys[0]) == 0
    assert [blocks._allocate(), blocks._allocate()] == [0, 2]
    assert blocks.evictions == 3 and blocks.num_cached == 0 and blocks.num_free == 0


def test_a_long_job_writes_again_the_blocks_it_has_touched_not_the_whole_pool():
    """200 short sequences through a pool of 1,000 blocks, four at a time: the blocks ever handed
    out are the peak's, so the rest of the pool's pages are never faulted in."""
    blocks = BlockManager(1000, BS, prefix_cache=False)
    sched = Scheduler(blocks, 4, 64)
    for i in range(200):
        sched.add(seq(i, [i % 50 + 1] * 9))
    while sched.has_work:
        run_step(sched)
        for s in [s for s in sched.running if s.num_computed >= 12]:
            sched.finish(s, "length")
    assert blocks.peak_used == 4 * 3 and blocks.high_water == blocks.peak_used


def test_a_prompt_whose_next_block_is_written_this_step_waits_one_step():
    blocks = BlockManager(16, BS, prefix_cache=True)
    sched = Scheduler(blocks, 8, 64)
    a, b, c = seq(0, list(range(9))), seq(1, list(range(8)) + [40]), seq(2, [99, 98])
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched) == [(0, 0, 9), (2, 0, 2)]  # b would share blocks a writes now: it waits
    assert run_step(sched) == [(1, 8, 1)]
    assert b.block_table[:2] == a.block_table[:2]


def test_prefix_cache_off_shares_nothing():
    blocks = BlockManager(16, BS)
    sched = Scheduler(blocks, 8, 64)
    for i in range(2):
        sched.add(seq(i, list(range(9))))
    assert run_step(sched) == [(0, 0, 9), (1, 0, 9)] and blocks.num_cached == 0


def test_max_hit_rate_counts_each_distinct_block_once():
    shared = list(range(8))
    prompts = [shared + [100 + i] for i in range(4)] + [[7, 7]]
    # 4 prompts of 9 tokens and one of 2 (38 tokens); 3 of the 4 take 8 tokens from the cache
    assert max_hit_rate(prompts, BS) == pytest.approx(24 / 38)
    assert max_hit_rate([[1, 2, 3]], BS) == 0.0


# --- the engine: equal output with and without the cache, shared blocks read-only ----------------


@pytest.fixture(scope="module")
def model(tmp_path_factory, one_torch_thread):
    # NOTE: a byte-level vocabulary of 268 tokens (the prompts' ids are below 250): each step's logits and draws small
    folder = tmp_path_factory.mktemp("prefix")
    path = build_tiny_decoder(folder, "LlamaForCausalLM", seed=21, max_positions=256, byte_level=True)
    return load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)


def shared_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts from 3 system prompts (20-45 tokens) and distinct 3-12 token questions, shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(5, 250) for _ in range(rng.randint(20, 45))] for _ in range(3)]
    prompts = [systems[i % 3] + [rng.randrange(5, 250) for _ in range(rng.randint(3, 12))] for i in range(n)]
    rng.shuffle(prompts)
    return prompts


def kv_bytes(model, blocks: int, block_size: int = 8) -> int:
    return blocks * KVLayout.of(model.cfg, block_size, torch.float32).bytes_per_block


def generate(model, prompts, params, **cfg) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, EngineConfig(**{"block_size": 8, **cfg}), eos_token_ids=())
    return [s.completion for s in engine.generate(prompts, params)], engine


PARAMS = {
    "greedy": [SamplingParams(max_tokens=12, ignore_eos=True)],
    "seeded": [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in range(3)],
}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize(
    "engine_cfg",
    [
        {"max_num_batched_tokens": 512, "max_num_seqs": 16},
        # chunked prefill: prompts split across steps, the cache found mid-prompt
        {"max_num_batched_tokens": 24, "max_num_seqs": 8},
        # a pool this small preempts; recomputed sequences find their own blocks cached
        {"max_num_batched_tokens": 64, "max_num_seqs": 8, "pool_blocks": 14},
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_output_with_the_cache_equals_output_without(model, sampling, engine_cfg):
    prompts = shared_prompts(24)
    each = PARAMS[sampling]
    params = [each[i % len(each)] for i in range(len(prompts))]
    cfg = dict(engine_cfg)
    if "pool_blocks" in cfg:
        cfg["kv_cache_memory"] = kv_bytes(model, cfg.pop("pool_blocks"))
    off, e_off = generate(model, prompts, params, prefix_cache=False, **cfg)
    on, e_on = generate(model, prompts, params, prefix_cache=True, **cfg)
    assert on == off
    assert e_off.stats.cached_tokens == 0 and e_on.stats.cached_tokens > 0
    assert e_on.stats.prefill_tokens + e_on.stats.cached_tokens == e_off.stats.prefill_tokens or (
        e_on.stats.preemptions or e_off.stats.preemptions
    )
    if "kv_cache_memory" in cfg:
        assert e_on.stats.preemptions > 0 and e_on.stats.evictions > 0
    if cfg["max_num_batched_tokens"] == 24:
        assert e_on.stats.continued_chunks > 0


def test_shared_blocks_are_never_written_and_fresh_blocks_are_poisoned(model):
    """Every block handed out fresh (empty or evicted) is filled with garbage, and every KV write is
    checked: it lands in a block held by exactly one sequence and registered under no key."""
    prompts = shared_prompts(24, seed=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    cfg = {"max_num_batched_tokens": 48, "max_num_seqs": 8, "kv_cache_memory": kv_bytes(model, 16)}
    want, _ = generate(model, prompts, params, prefix_cache=False, **cfg)
    engine = Engine(model, EngineConfig(block_size=8, prefix_cache=True, **cfg), eos_token_ids=())
    blocks, cache = engine.blocks, engine.cache
    take, write = blocks._allocate, cache.write
    written: list[int] = []

    def poisoned_allocate() -> int:
        block = take()
        cache.k[:, block] = 1e3  # finite: masked reads of a fresh block's tail give weight 0
        cache.v[:, block] = -1e3
        return block

    def guarded_write(layer, slots, k, v):
        keyed = {b for b in range(blocks.num_blocks) if blocks._key[b] is not None}
        for block in {int(s) // blocks.block_size for s in slots}:
            assert blocks.ref[block] == 1, f"write into block {block} held by {blocks.ref[block]}"
            assert block not in keyed, f"write into cached block {block}"
            written.append(block)
        write(layer, slots, k, v)

    blocks._allocate = poisoned_allocate  # type: ignore[method-assign]
    cache.write = guarded_write  # type: ignore[method-assign]
    got = [s.completion for s in engine.generate(prompts, params)]
    assert got == want
    assert written and engine.stats.cached_tokens > 0 and engine.stats.evictions > 0


def test_the_hit_rate_equals_the_theoretical_one(model):
    prompts = shared_prompts(30, seed=5)
    _, engine = generate(
        model, prompts, SamplingParams(max_tokens=2, ignore_eos=True), max_num_batched_tokens=512, max_num_seqs=32
    )
    seqs_cached = engine.stats.cached_tokens
    total = sum(len(p) for p in prompts)
    assert seqs_cached / total == pytest.approx(max_hit_rate(prompts, 8)) and seqs_cached > 0
