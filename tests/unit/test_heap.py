"""The C heap kept for reuse (hpcinfer/device/heap.py), judged by the kernel's own count of the page
faults a process takes (getrusage's ru_minflt).

A batch's activations live together and are freed together: six 8 MB tensors here. Under glibc's
defaults the heap's free top, once past its trim threshold, goes back to the kernel and the next
batch faults every page in again (`benchmarks/speed/bench_heap.py` measures it on a real run);
a process hpcinfer's command line started keeps it. Each case runs in a fresh interpreter:
malloc's settings are the process's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcinfer.device.heap import keep_freed_memory

PROBE = """
import resource, sys
import torch
{setup}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):  # the heap grown once
    live = [torch.ones(2 << 20) for _ in range(6)]
    del live
before = faults()
live = [torch.ones(2 << 20) for _ in range(12)]  # a batch twice as large: the heap grows
del live
grown = faults() - before
before = faults()
for _ in range(10):
    live = [torch.ones(2 << 20) for _ in range(6)]
    del live
print(grown, (faults() - before) / 10)
"""
PAGES = 6 * (8 << 20) // 4096  # a batch's pages: what a batch faults in when nothing is kept

CLI = """
from hpcinfer.cli import main
try:
    main(["report", "--help"], standalone_mode=False)  # the group's start, as every command's
except SystemExit:
    pass
"""

needs_glibc = pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc")


def faults(setup: str, **env: str) -> tuple[float, float]:
    """(faults while the heap grew by a batch's pages, faults per batch after)."""
    code = PROBE.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout  # fmt: skip
    grown, per_batch = out.split()[-2:]
    return float(grown), float(per_batch)


@needs_glibc
def test_a_command_keeps_the_heap_and_a_batch_faults_no_page_in_again():
    grown, per_batch = faults(CLI)
    assert grown > 0.9 * PAGES  # NOTE: the probe sees the faults of memory the process had not touched
    assert per_batch < 0.1 * PAGES


def test_hpcinfer_heap_system_leaves_malloc_as_it_was():
    """glibc's own settings, which give a batch's memory back when its top is free (whether it is
    depends on what else the heap holds, so this says only that nothing was set)."""
    code = CLI + "from hpcinfer.device import heap; print(heap._kept)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HPCINFER_HEAP": "system"}).stdout  # fmt: skip
    assert out.split()[-1] == "False"


@needs_glibc
def test_keeping_is_said_once_and_the_same_after():
    assert keep_freed_memory() is keep_freed_memory() is True
