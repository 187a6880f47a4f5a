"""Models kept loaded between runs of one process (`hpcinfer serve`'s batches), so a queue of small
jobs does not spend its time loading the same weights again.

A run asks the shelf for what it would load (`get(key, load)`); the key names everything the
loaded object depends on (checkpoint, device, dtype, quantization), so a run with other options
loads its own. At most `keep` models stay (the least recently used goes first, before the next
one loads, so two never sit in memory together because of the shelf). What serves a model
(`attached`: its tokenizer, its engine's KV pool) rides along uncounted and goes with it. `keep=0`
keeps nothing: every run loads, as a fresh process would.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")
MOST_ATTACHED = 8  # tokenizers and KV pools: a few per model


class ModelShelf:
    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._models: OrderedDict[Hashable, Any] = OrderedDict()
        self._attached: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.load_s = 0.0  # seconds spent loading models, in all (a caller's difference is its own run's)

    def get(self, key: Hashable, load: Callable[[], T], *, attached: bool = False) -> T:
        """What `load` returns, loaded now or kept from an earlier run; `attached`: what serves a
        model (a tokenizer, a KV pool), uncounted, dropped with the models."""
        kept = self._attached if attached else self._models
        with self._lock:
            if key in kept:
                kept.move_to_end(key)
                return kept[key]
            if not attached and self._models and len(self._models) >= max(self.keep, 1):
                while self._models and len(self._models) >= max(self.keep, 1):
                    self._models.popitem(last=False)
                self._attached.clear()  # NOTE: a KV pool sized for the old model goes with it
                gc.collect()  # NOTE: the evicted weights freed before the next ones load
        start = time.perf_counter()
        value = load()
        with self._lock:
            if not attached:
                self.load_s += time.perf_counter() - start
            if self.keep > 0:
                kept[key] = value
                if attached and len(kept) > MOST_ATTACHED:
                    kept.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._models)

    def kept(self) -> list[Hashable]:
        """The keys of what is kept now: models, then what serves them."""
        with self._lock:
            return [*self._models, *self._attached]


def shelved(shelf: ModelShelf | None, key: Hashable, load: Callable[[], T], *, attached: bool = False) -> T:
    """`load()` through the shelf when there is one (a server's run), else loaded now (a CLI run)."""
    return load() if shelf is None else shelf.get(key, load, attached=attached)
