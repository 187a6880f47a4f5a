"""The process's C heap kept for reuse: `keep_freed_memory`.

Why: a CPU forward allocates its activations afresh every batch (a 4,096-token batch of the
default model holds 6 MB of hidden states and 25 MB of feed-forward output at once) and frees
them together when the batch ends. Under glibc's own settings the heap's free top then goes back
to the kernel once it passes a trim threshold (twice the largest block freed so far, 64 MB at
most), so the next batch faults every page in again: the kernel finds, zeroes and maps 4 KiB at
a time, ~800,000 faults and 2.5 s of system time in an embedding run of 1,000 rows of the
default model (`benchmarks/speed/bench_heap.py`). Kept instead, the freed memory serves the next
batch's allocations as it is. The cost is resident memory that stays at the process's peak
instead of shrinking after it, as a caching allocator's does (the GPU's keeps its blocks so too).

Only glibc's malloc is set, and only where the user has not chosen: `HPCINFER_HEAP=system`, a
malloc of their own in `LD_PRELOAD` (jemalloc, tcmalloc, mimalloc) or glibc's own malloc settings
in the environment (`GLIBC_TUNABLES`, `MALLOC_*_`) leave it as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# NOTE: blocks up to 32 MB come from the heap: older glibc refuses a larger mmap threshold, and a
# thread's own arena grows in 64 MB sub-heaps, which hold blocks up to half that. Larger blocks
# are still mapped one by one.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # the main heap's free top is given back past this much
# NOTE: the forward runs on a thread of its own, whose arena frees a whole empty sub-heap unless
# the top pad is at least a sub-heap (glibc's heap_trim keeps `top_pad`): 64 MB keeps it
TOP_PAD = 64 << 20
ENV = "HPCINFER_HEAP"

_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory for reuse, once per process; True where it is in
    effect (False: `HPCINFER_HEAP=system`, another malloc or the user's own settings, not glibc)."""
    global _kept
    if _kept is None:
        _kept = not _user_chose() and _mallopt_all()
    return _kept


def _user_chose() -> bool:
    """Whether the user chose how this process allocates: `HPCINFER_HEAP=system`, a malloc of
    their own in LD_PRELOAD (jemalloc, tcmalloc, mimalloc: their own rules), glibc's settings."""
    env = os.environ
    return (env.get(ENV, "").strip().lower() == "system" or "malloc" in env.get("LD_PRELOAD", "")
            or "glibc.malloc" in env.get("GLIBC_TUNABLES", "")
            or any(name.startswith("MALLOC_") and name.endswith("_") for name in env))  # fmt: skip


def _mallopt_all() -> bool:
    if platform.libc_ver()[0] != "glibc":  # NOTE: another C library's mallopt may mean other things, or nothing
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return [mallopt(param, value) for param, value in settings] == [1, 1, 1]
