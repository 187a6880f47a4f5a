"""CPU-shaped sizes derived from this machine's caches, read once at start-up.

The CPU paths cut matmuls and attention into pieces that stay in cache (the LM head's vocabulary
slices, the MLP's column slices, the decode groups' gathered K/V). Their sizes follow from one
core's L2, read from sysfs (microseconds), so a CPU with a smaller L2 gets smaller pieces instead
of numbers tuned on another machine. Where the caches cannot be read, the sizes of the CPU they
were first measured on (2 MiB of L2 per core) stand.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True, slots=True)
class CpuCaches:
    """One core's view of its caches, in bytes (0 where a level is absent or unreadable)."""

    l1d: int
    l2: int
    l3: int


# NOTE: the CPU the slice sizes were first measured on (Xeon, AVX-512): 48 KiB L1d, 2 MiB L2 per core.
FALLBACK = CpuCaches(l1d=48 << 10, l2=2 << 20, l3=0)

SLICE_MIN, SLICE_MAX = 256, 1024  # rows; below 256 the per-matmul overhead shows (20% at hidden 2048)


def parse_size(text: str) -> int:
    """sysfs cache sizes: '2048K', '48K', '1M' -> bytes; raises ValueError otherwise."""
    text = text.strip()
    unit = _UNITS.get(text[-1:].upper(), 1)
    return int(text[:-1] if unit > 1 else text) * unit


def read_caches(root: Path = CACHE_DIR) -> CpuCaches:
    """The data and unified caches of one CPU from `root` (sysfs' cpu0/cache layout); FALLBACK
    when nothing can be read (another OS, a container hiding sysfs)."""
    sizes: dict[int, int] = {}
    try:
        for index in sorted(root.glob("index*")):
            kind = (index / "type").read_text().strip()
            if kind not in ("Data", "Unified"):
                continue
            sizes[int((index / "level").read_text())] = parse_size((index / "size").read_text())
    except (OSError, ValueError):
        return FALLBACK
    if not sizes.get(2):
        return FALLBACK
    return CpuCaches(l1d=sizes.get(1, 0), l2=sizes[2], l3=sizes.get(3, 0))


@functools.cache
def machine_caches() -> CpuCaches:
    """This machine's caches, read on first use and kept."""
    return read_caches()


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def matmul_slice_rows(row_bytes: int, caches: CpuCaches | None = None) -> int:
    """Weight rows per slice of a sliced CPU matmul (LM head, MLP gate/up): the largest power of
    two whose slice fills at most three quarters of one core's L2, the rest left for the
    activation rows and the output slice; within [SLICE_MIN, SLICE_MAX].

    NOTE: 512 on a 2 MiB L2 at hidden 576 or 512 in float32, the size measured fastest there;
    256 on a 1 MiB L2. Between 256 and 1024 rows the measured times are flat on that machine.
    """
    l2 = (caches or machine_caches()).l2
    return min(SLICE_MAX, max(SLICE_MIN, _pow2_floor(3 * l2 // 4 // max(row_bytes, 1))))


def decode_group_bytes(caches: CpuCaches | None = None) -> int:
    """The gathered K and V of one decode group, in bytes: twice one core's L2, so that K, then V,
    each fits in L2 while SDPA reads it (4 MiB on a 2 MiB L2, the size measured fastest there)."""
    return 2 * (caches or machine_caches()).l2
