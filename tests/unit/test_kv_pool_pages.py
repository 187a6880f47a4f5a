"""The CPU KV pool's memory: a mapping of its own, paged in as blocks are written, never advised to
use transparent huge pages (whose first-touch faults cost 20-50 ms each on a virtual machine whose
host takes free memory back: benchmarks/speed/bench_kv_pages.py), and unmapped with the pool.
Read from the kernel's own account of this process's mappings (/proc/self/smaps)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from hpcinfer.engine.kvcache.pools import KVCache, KVLayout

SMAPS = Path("/proc/self/smaps")


def mapping_of(address: int) -> dict[str, str] | None:
    """The smaps entry (its fields, and `range`) of the mapping holding `address`, or None."""
    entry: dict[str, str] | None = None
    for line in SMAPS.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms offset ...
            if entry is not None:
                return entry
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {"range": head} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def kib(field: str) -> int:
    return int(field.split()[0])


@pytest.mark.skipif(not SMAPS.exists(), reason="needs Linux's /proc/self/smaps")
def test_a_cpu_pool_pages_in_as_written_without_huge_page_advice_and_goes_with_its_cache():
    layout = KVLayout(4, 2, 64, 16, torch.float32)  # 4 layers, 2 KV heads of 64, blocks of 16 tokens
    cache = KVCache(layout, 2048, torch.device("cpu"))  # 64 MiB of K: far past numpy's 4 MiB huge-page line
    block_kib = 16 * 2 * 64 * 4 // 1024  # one layer's block of K: 8 KiB
    block = cache.keys(0)[100].data_ptr()  # NOTE: advice splits a mapping: each check reads the block's own
    k = mapping_of(block)
    assert k is not None and cache.k.nbytes == 64 << 20
    assert "hg" not in k["VmFlags"].split(), k  # no MADV_HUGEPAGE on the pool (numpy's zeros ask for it)
    assert kib(k["Rss"]) <= 64, k  # nothing resident before a write (a page or two of its edge at most)
    cache.write(0, torch.arange(16 * 100, 16 * 101), torch.ones(16, 2, 64), torch.ones(16, 2, 64))  # block 100
    k = mapping_of(block)
    assert k is not None and block_kib <= kib(k["Rss"]) <= 64, k  # the block's pages, not 2 MiB of them
    assert torch.equal(cache.keys(0)[100], torch.ones(16, 2, 64)) and not cache.keys(0)[99].any()
    where = k["range"]
    del cache, k
    gc.collect()
    assert where not in SMAPS.read_text()  # unmapped with the pool
