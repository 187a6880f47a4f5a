"""A source run ahead of its consumer on a thread of its own: reading and tokenizing overlap the
work that consumes them, and the thread can be pinned to cores of its own (`--cpu-affinity`).

At most `depth` items wait in the queue, so memory stays bounded however far the input goes. An
exception in the source reaches the consumer at the item where it happened, as if it iterated
the source itself; `close()` stops the thread wherever it is.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_END = object()  # the source is exhausted
_POLL_S = 0.1  # how often a producer blocked on a full queue checks whether it was closed


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ReadAhead(Generic[T]):
    """`source`'s items, produced up to `depth` ahead on a thread named `name` that runs `init` first."""

    def __init__(
        self, source: Iterator[T], depth: int, name: str = "tokenize", init: Callable[[], None] | None = None
    ) -> None:
        self._source, self._init = source, init
        self._queue: queue.Queue[object] = queue.Queue(max(1, depth))
        self._closed = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> ReadAhead[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._done = True
            raise item.exc
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stops the producer (it may be blocked on a full queue) and waits for it."""
        self._closed.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=_POLL_S)
        self._done = True

    def _produce(self) -> None:
        try:
            if self._init is not None:
                self._init()
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, raised where it asks for the next item
            self._put(_Failed(exc))

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False


__all__ = ["ReadAhead"]
