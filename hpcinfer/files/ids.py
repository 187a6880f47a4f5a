"""Row ids: what a valid id is, and the compact set of ids seen so far (duplicate detection)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np


class IdSet:
    """The ids seen so far, as 64-bit hashes: sorted numpy arrays plus a small set of recent ones.

    NOTE: 8 bytes a row instead of ~130 for a Python set of ints, so memory stays flat on files of
    millions of rows. Recent keys become a sorted chunk of `_MERGE_AT` keys, and `_FANIN` chunks one
    sorted run; neither is ever reallocated. Merging everything into one ever-growing array instead
    (a new, bigger array and its temporaries each time) fragmented the heap: glibc raises its mmap
    threshold to the size of the freed arrays, so later ones came from the heap and the reader alone
    grew by ~65 MiB over a million rows. Lookups are per block, vectorised (`contains_many`).
    """

    _MERGE_AT = 1 << 16
    _FANIN = 16
    _MASK = 0xFFFFFFFFFFFFFFFF

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []  # sorted uint64, about _MERGE_AT * _FANIN keys each
        self._chunks: list[np.ndarray] = []  # sorted uint64, about _MERGE_AT keys each
        self._recent: set[int] = set()

    def __contains__(self, key: int) -> bool:
        key &= self._MASK
        if key in self._recent:
            return True
        k = np.uint64(key)
        for keys in (*self._runs, *self._chunks):
            i = int(np.searchsorted(keys, k))
            if i < len(keys) and keys[i] == k:
                return True
        return False

    def contains_many(self, keys: np.ndarray) -> np.ndarray:
        """A bool per key (uint64): seen before."""
        found = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return found
        for sorted_keys in (*self._runs, *self._chunks):
            i = np.searchsorted(sorted_keys, keys)
            np.minimum(i, len(sorted_keys) - 1, out=i)
            found |= sorted_keys[i] == keys
        if self._recent:
            recent = self._recent
            found |= np.fromiter((k in recent for k in keys.tolist()), bool, len(keys))
        return found

    def add(self, key: int) -> None:
        self._recent.add(key & self._MASK)
        if len(self._recent) >= self._MERGE_AT:
            self._merge()

    def add_many(self, keys: np.ndarray) -> None:
        """Adds uint64 keys (none of them seen before)."""
        self._recent.update(keys.tolist())
        if len(self._recent) >= self._MERGE_AT:
            self._merge()

    def update(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.add(key)

    def _merge(self) -> None:
        chunk = np.fromiter(self._recent, np.uint64, len(self._recent))
        chunk.sort()
        self._chunks.append(chunk)
        self._recent.clear()
        if len(self._chunks) >= self._FANIN:
            run = np.concatenate(self._chunks)
            run.sort()
            self._runs.append(run)
            self._chunks = []


def check_id(value: Any) -> tuple[str, str] | None:
    """An id is a string, an integer or absent (null); anything else is the row's problem."""
    if isinstance(value, str):
        if not is_unicode(value):
            return "invalid_id", "id holds a lone surrogate (e.g. an escaped \\ud800), not valid Unicode"
        return None
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return None
    kind = "boolean" if isinstance(value, bool) else type(value).__name__
    return "invalid_id", f"id is a {kind}; an id must be a string or an integer"


def is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON can escape one: "\\ud800"): no UTF-8 for it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def id_key(row_id: str | int) -> int:
    """What the duplicate check remembers of an id: 64 bits of blake2b over its text.

    NOTE: an integer and the string of its digits are one id (5 and "5"): a file mixing the two
    would otherwise write both, and its output column, which holds one type, could not tell them
    apart. Not Python's hash(): that one maps ints modulo 2**61 - 1, so large numeric ids collide.
    """
    text = str(row_id).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
