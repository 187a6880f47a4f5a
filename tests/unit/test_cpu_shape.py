"""CPU-shaped sizes come from the machine's caches: the sizes measured on the 2 MiB-L2 Xeon there,
smaller ones on a 1 MiB-L2 AVX2 desktop, the old constants where sysfs says nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcinfer.device.cpu_shape import (
    FALLBACK,
    CpuCaches,
    decode_group_bytes,
    machine_caches,
    matmul_slice_rows,
    parse_size,
    read_caches,
)

XEON = CpuCaches(l1d=48 << 10, l2=2 << 20, l3=480 << 20)  # the AVX-512 machine the sizes were measured on
AVX2 = CpuCaches(l1d=32 << 10, l2=1 << 20, l3=8 << 20)  # a desktop AVX2 part
SMOLLM2_ROW = 576 * 4  # one float32 row of SmolLM2-135M's LM head / MLP weight


def _sysfs(root: Path, caches: list[tuple[int, str, str]]) -> Path:
    for i, (level, kind, size) in enumerate(caches):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_sysfs_cache_sizes_are_read(tmp_path):
    files = [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"), (3, "Unified", "491520K")]
    root = _sysfs(tmp_path, files)
    assert read_caches(root) == XEON
    assert parse_size("1M") == 1 << 20 and parse_size("512") == 512


UNREADABLE = [[], [(1, "Data", "48K")], [(2, "Unified", "lots")]]


@pytest.mark.parametrize("files", UNREADABLE, ids=["none", "no-l2", "garbled"])
def test_unreadable_caches_fall_back_to_the_measured_machine(tmp_path, files):
    assert read_caches(_sysfs(tmp_path / "cache", files)) == FALLBACK
    assert read_caches(tmp_path / "missing") == FALLBACK


def test_the_xeon_gets_the_sizes_measured_on_it():
    """CPU_VOCAB_CHUNK and CPU_MLP_SLICE were 512 rows, CPU_DECODE_GROUP_BYTES 4 MiB."""
    assert matmul_slice_rows(SMOLLM2_ROW, XEON) == 512
    assert matmul_slice_rows(512 * 4, XEON) == 512  # the MLP slice's own measurement: hidden 512
    assert decode_group_bytes(XEON) == 4 << 20
    assert matmul_slice_rows(SMOLLM2_ROW, FALLBACK) == 512 and decode_group_bytes(FALLBACK) == 4 << 20


def test_a_smaller_l2_gets_smaller_pieces():
    assert matmul_slice_rows(SMOLLM2_ROW, AVX2) == 256
    assert decode_group_bytes(AVX2) == 2 << 20
    assert matmul_slice_rows(SMOLLM2_ROW, AVX2) * SMOLLM2_ROW <= 3 * AVX2.l2 // 4


@pytest.mark.parametrize("row_bytes", [64, 2048, 576 * 4, 2048 * 4, 8192 * 4])
def test_slices_stay_within_bounds(row_bytes):
    for caches in (XEON, AVX2, CpuCaches(0, 256 << 10, 0), CpuCaches(0, 32 << 20, 0)):
        rows = matmul_slice_rows(row_bytes, caches)
        assert 256 <= rows <= 1024 and rows & (rows - 1) == 0


def test_this_machine_is_read_once():
    assert machine_caches() is machine_caches() and machine_caches().l2 > 0
