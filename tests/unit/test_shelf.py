"""The model shelf `hpcinfer serve` keeps between batches: a model loads once per key, the least
recently used goes before another loads (two never sit in memory because of the shelf), keep=0 keeps
nothing, tokenizers ride along uncounted."""

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
    shelf.get("tok", lambda: "tokenizer", small=True)
    assert len(shelf) == 1 and shelf.get("tok", lambda: "other", small=True) == "tokenizer"
    assert shelf.load_s > 0


def test_keep_zero_and_no_shelf_load_every_time():
    calls = []
    for shelf in (ModelShelf(keep=0), None):
        for _ in range(2):
            shelved(shelf, "a", lambda: calls.append(1))
    assert len(calls) == 4
