"""The model shelf `hpcinfer serve` keeps between batches: a model loads once per key, the least
recently used goes before another loads (two never sit in memory because of the shelf), keep=0 keeps
nothing, what serves a model (tokenizer, KV pool) rides along uncounted and goes with it."""

from __future__ import annotations

import gc
import weakref

from hpcinfer.models.shelf import ModelShelf, shelved


class Weights:
    pass


def test_a_model_loads_once_and_the_oldest_goes_before_the_next_loads():
    shelf, loads, alive = ModelShelf(keep=1), [], []

    def load(name: str):  # noqa: ANN202
        def make() -> Weights:
            gc.collect()
            alive.append(sum(ref() is not None for ref in refs))  # models still held when this one loads
            loads.append(name)
            made = Weights()
            refs.append(weakref.ref(made))
            return made

        return make

    refs: list[weakref.ref] = []
    first = shelf.get("a", load("a"))
    assert shelf.get("a", load("a")) is first and loads == ["a"]
    del first
    shelf.get("b", load("b"))
    assert loads == ["a", "b"] and alive == [0, 0]  # "a" was freed before "b" loaded
    shelf.get("tok", lambda: "tokenizer", attached=True)
    assert len(shelf) == 1 and shelf.get("tok", lambda: "other", attached=True) == "tokenizer"
    assert shelf.load_s > 0
    shelf.get("c", load("c"))  # NOTE: what served the evicted model goes with it
    assert shelf.get("tok", lambda: "reloaded", attached=True) == "reloaded"


def test_keep_zero_and_no_shelf_load_every_time():
    calls = []
    for shelf in (ModelShelf(keep=0), None):
        for _ in range(2):
            shelved(shelf, "a", lambda: calls.append(1))
    assert len(calls) == 4


def test_a_kept_kv_pool_is_zeroed_where_its_last_engine_wrote():
    import torch

    from hpcinfer.engine.kvcache.block_manager import BlockManager
    from hpcinfer.engine.kvcache.pools import KVCache, KVLayout

    cache = KVCache(KVLayout(2, 1, 4, 4, torch.float32), 16, torch.device("cpu"))
    blocks = BlockManager(16, 4)
    cache.writer = blocks
    written = [blocks._allocate() for _ in range(3)]
    cache.k[:, written] = float("nan")  # NOTE: what a broken batch may leave: masked reads would still see it
    cache.v[:, written] = 1.0
    cache.k[:, 10] = 7.0  # NOTE: beyond the blocks handed out: never written by an engine, left as it is
    cache.clear_written()
    assert torch.equal(cache.k[:, :3], torch.zeros_like(cache.k[:, :3])) and not cache.v[:, :3].any()
    assert (cache.k[:, 10] == 7.0).all() and cache.writer is None
