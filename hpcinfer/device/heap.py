"""The process's C heap kept for reuse: `keep_freed_memory`.

Why: a CPU forward allocates its activations afresh every batch (an encoder's FFN output of a
4,096-token batch is 6-25 MB), and glibc's malloc serves blocks that size with `mmap` and hands
them back with `munmap` when torch frees them, so the next batch faults every page in again: the
kernel finds, zeroes and maps 4 KiB at a time, ~1 million faults (2-3 s of system time) in an
embedding run of 1,000 rows of the default model (`benchmarks/speed/bench_heap.py`). Kept in the
heap instead, freed blocks serve the next batch's allocations as they are. The cost is the
process's resident memory staying at its peak instead of shrinking after it, as a caching
allocator's does (a GPU's caching allocator keeps its blocks the same way).

glibc only: another C library (musl) or platform keeps its own behaviour. `HPCINFER_HEAP=system`
leaves malloc as it was, for a process that must give freed memory back at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# NOTE: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX: it refuses more);
# larger blocks are still mapped one by one
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top given back past this much
TOP_PAD = 64 << 20  # what the heap grows by beyond a request, so growing is rare
ENV = "HPCINFER_HEAP"

_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed blocks of up to 32 MB for reuse, once per process; True
    where it is in effect (False: `HPCINFER_HEAP=system`, or not glibc)."""
    global _kept
    if _kept is None:
        _kept = os.environ.get(ENV, "").strip().lower() != "system" and _mallopt_all()
    return _kept


def _mallopt_all() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  NOTE: glibc's own symbol: another libc's mallopt may mean other things
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # NOTE: the mmap threshold first: setting any of these turns off glibc's own adjusting of it
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))  # fmt: skip
