"""The C heap kept for reuse (hpcinfer/device/heap.py), judged by the kernel's own count of the page
faults a process takes (getrusage's ru_minflt).

A batch's activations live together and are freed together: twelve 8 MB tensors here. Under glibc's
defaults the heap's free top, once past its trim threshold, may go back to the kernel, and the next
batch faults every page in again (`benchmarks/speed/bench_heap.py` measures it on a real run);
a process whose command computes (`run` here; `tune`, `serve` and `profile` alike) keeps it. Each
case runs in a fresh interpreter (malloc's settings are the process's), with transparent huge
pages off for it, so that a fault is a page of the size the kernel reports.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import ctypes, resource, sys, threading
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: a fault is one page
import torch
{setup}
from hpcinfer.device import heap

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def batch(tensors):
    live = [torch.ones(2 << 20) for _ in range(tensors)]  # 8 MB each
    del live

def probe(out):
    for _ in range(2):  # the heap grown once
        batch({tensors})
    before = faults()
    batch(2 * {tensors})  # a batch twice as large: the heap grows
    grown = faults() - before
    before = faults()
    for _ in range(10):
        batch({tensors})
    out.extend((grown, (faults() - before) / 10))

out = []
if {on_a_thread}:  # NOTE: as the pipeline's compute thread, whose allocations are in an arena of its own
    thread = threading.Thread(target=probe, args=(out,))
    thread.start()
    thread.join()
else:
    probe(out)
print(heap._kept, *out)
from hpcinfer.process_end import end_process  # as the hpcinfer program ends
end_process(0)
"""
TENSORS = 12
PAGES = TENSORS * (8 << 20) // os.sysconf("SC_PAGE_SIZE")  # what a batch faults in when nothing is kept

# a command that computes, in this process: `hpcinfer run` on a few rows of a tiny model
CLI = """
from hpcinfer.cli import main
main(["run", {src!r}, "-o", {out!r}, "--model", {model!r}, "--progress", "off", "-q"], standalone_mode=False)
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


def cli_run(folder: Path, model: Path) -> str:
    src = folder / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "text": "row {i} of a few words"}}\n' for i in range(8)))
    return CLI.format(src=str(src), out=str(folder / "out.parquet"), model=str(model))


def faults(setup: str, on_a_thread: bool = False, **env: str) -> tuple[bool | None, float, float]:
    """(whether the process set its heap, faults while the heap grew by a batch's pages, faults
    per batch after)."""
    code = PROBE.format(setup=setup, tensors=TENSORS, on_a_thread=on_a_thread)
    environ = {k: v for k, v in os.environ.items() if k != "HPCINFER_HEAP"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**environ, **env}).stdout  # fmt: skip
    kept, grown, per_batch = out.split()[-3:]
    return {"True": True, "False": False}.get(kept), float(grown), float(per_batch)


@pytest.mark.parametrize("on_a_thread", [False, True], ids=["main thread", "another thread"])
def test_a_command_keeps_the_heap_and_a_batch_faults_no_page_in_again(tmp_path, tiny_model, on_a_thread):
    kept, grown, per_batch = faults(cli_run(tmp_path, tiny_model), on_a_thread)
    assert kept is True
    assert grown > 0.9 * PAGES  # NOTE: the probe sees the faults of memory the process had not touched
    assert per_batch < 0.1 * PAGES


def test_hpcinfer_heap_system_leaves_malloc_as_glibc_has_it(tmp_path, tiny_model):
    """Nothing set. (glibc's own settings give a batch's memory back when the heap's top is free;
    whether it is depends on what else the heap holds, so the faults are not asserted here.)"""
    kept, grown, _ = faults(cli_run(tmp_path, tiny_model), HPCINFER_HEAP="system")
    assert kept is False and grown > 0.9 * PAGES


def test_a_malloc_the_user_chose_is_left_alone(tmp_path, tiny_model):
    kept, _, _ = faults(cli_run(tmp_path, tiny_model), MALLOC_TRIM_THRESHOLD_="1048576")
    assert kept is False
