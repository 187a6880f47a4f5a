"""The CPU KV pool's memory: a private mapping of its own, paged in as blocks are written, never
advised to use transparent huge pages (whose first-touch faults cost 20-50 ms each on a virtual
machine whose host takes free memory back: benchmarks/speed/bench_kv_pages.py), and given back with
the pool. Read from the kernel's own account of this process's memory: /proc/self/smaps for the
mapping's flags, /proc/self/pagemap for which of its pages are resident."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from hpcinfer.engine.kvcache.pools import KVCache, KVLayout

SMAPS, PAGEMAP = Path("/proc/self/smaps"), Path("/proc/self/pagemap")


def mapping_of(address: int) -> dict[str, str] | None:
    """The smaps entry (its fields, `range` and `perms`) of the mapping holding `address`, or None.
    NOTE: the kernel merges neighbouring mappings of the same flags, so the entry may hold more."""
    entry: dict[str, str] | None = None
    for line in SMAPS.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms offset ...
            if entry is not None:
                return entry
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {"range": head, "perms": line.split()[1]} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def resident_pages(address: int, nbytes: int) -> int:
    """How many of the pages under [address, address + nbytes) are in memory (pagemap's bit 63 of each)."""
    page = mmap.PAGESIZE
    first, last = address // page, (address + nbytes - 1) // page
    with PAGEMAP.open("rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    return sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))


@pytest.mark.skipif(not PAGEMAP.exists(), reason="needs Linux's /proc/self/smaps and pagemap")
def test_a_cpu_pool_pages_in_as_written_without_huge_page_advice_and_goes_with_its_cache():
    layout = KVLayout(4, 2, 64, 16, torch.float32)  # 4 layers, 2 KV heads of 64, blocks of 16 tokens
    cache = KVCache(layout, 2048, torch.device("cpu"))  # 64 MiB of K: far past numpy's 4 MiB huge-page line
    pool = (cache.k.data_ptr(), cache.k.nbytes)
    block = (cache.keys(0)[100].data_ptr(), cache.keys(0)[100].nbytes)  # one layer's block of K: 8 KiB, 2 pages
    k = mapping_of(block[0])  # NOTE: huge-page advice splits a mapping: read the block's own
    assert k is not None and pool[1] == 64 << 20
    assert "hg" not in k["VmFlags"].split(), k  # no MADV_HUGEPAGE on the pool (numpy's zeros ask for it)
    assert k["perms"] == "rw-p", k  # private: not shmem, which a forked child would share
    assert resident_pages(*pool) == 0  # nothing in memory before a write
    cache.write(0, torch.arange(16 * 100, 16 * 101), torch.ones(16, 2, 64), torch.ones(16, 2, 64))  # block 100
    assert resident_pages(*block) == block[1] // mmap.PAGESIZE
    assert resident_pages(*pool) == block[1] // mmap.PAGESIZE  # the block's pages, not 2 MiB of them
    assert torch.equal(cache.keys(0)[100], torch.ones(16, 2, 64)) and not cache.keys(0)[99].any()
    del cache
    gc.collect()
    assert resident_pages(*pool) == 0  # given back with the pool
