"""The planner: token budgets, buckets, windows (pure numpy, table-tested)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcinfer.config import PlanConfig
from hpcinfer.pipeline.plan import Planner, cut_batches
from hpcinfer.pipeline.stage import scatter_rows
from hpcinfer.pipeline.types import TokenBlock


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=400),
    max_tokens=st.sampled_from([304, 512, 1024, 4096]),
    max_rows=st.integers(1, 64),
    multiple=st.sampled_from([1, 8, 16]),
)
def test_batches_cover_every_row_once_within_budget(lengths, max_tokens, max_rows, multiple):
    lengths = np.array(lengths, dtype=np.int32)
    batches = cut_batches(lengths, max_tokens, max_rows, multiple)
    rows = np.concatenate([r for r, _ in batches]) if batches else np.array([], dtype=np.int64)
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for r, width in batches:
        assert width % multiple == 0
        assert lengths[r].max() <= width < lengths[r].max() + multiple  # only rounding, no extra padding
        assert len(r) <= max_rows
        assert len(r) * width <= max_tokens or len(r) == 1


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "max_rows", "expected"),
    [
        ([5, 9, 16, 3], 64, 8, [([2, 1], 16), ([0, 3], 8)]),  # two buckets, longest first
        ([8] * 10, 32, 8, [([0, 1, 2, 3], 8), ([4, 5, 6, 7], 8), ([8, 9], 8)]),  # budget cuts
        ([8] * 10, 1000, 3, [([0, 1, 2], 8), ([3, 4, 5], 8), ([6, 7, 8], 8), ([9], 8)]),  # row cap cuts
        ([100], 64, 8, [([0], 104)]),  # a row longer than the budget still gets a batch of its own
    ],
)
def test_cut_batches_table(lengths, max_tokens, max_rows, expected):
    got = cut_batches(np.array(lengths, dtype=np.int32), max_tokens, max_rows, 8)
    assert [(r.tolist(), w) for r, w in got] == expected


def test_planner_windows_and_batches_keep_every_row():
    planner = Planner(PlanConfig(sort_window=10, max_batch_tokens=64, max_batch_size=4))
    rng = np.random.default_rng(0)
    batches = []
    first = 0
    for block_id, size in enumerate([7, 3, 7, 3, 5]):  # the reader never lets a block cross a window edge
        lengths = rng.integers(2, 30, size=size).astype(np.int32)
        flat = rng.integers(1, 1000, size=int(lengths.sum())).astype(np.int32)
        ids = list(range(first, first + size))
        rows = np.arange(first, first + size)
        batches += list(planner.process(TokenBlock(block_id, first, size, ids, flat, lengths, rows=rows)))
        first += size
    batches += list(planner.finish())
    windows = {}
    for b in batches:
        windows.setdefault(b.window.window_id, []).append(b)
    assert [len(w[0].window) for w in windows.values()] == [10, 10, 5]
    for bs in windows.values():
        assert len(bs) == bs[0].window.num_batches
        assert sorted(np.concatenate([b.rows for b in bs]).tolist()) == list(range(len(bs[0].window)))


def test_scatter_rows_matches_a_python_loop():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 20, size=12).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = rng.integers(1, 500, size=int(lengths.sum())).astype(np.int32)
    rows = np.array([3, 7, 0, 11])
    dst = np.full(200, -1, dtype=np.int32)
    scatter_rows(dst, flat, offsets, rows, lengths[rows], 24, 0)
    expected = np.zeros((4, 24), dtype=np.int32)
    for i, r in enumerate(rows):
        expected[i, : lengths[r]] = flat[offsets[r] : offsets[r + 1]]
    assert (dst[: 4 * 24].reshape(4, 24) == expected).all()
    assert (dst[4 * 24 :] == -1).all()  # nothing written past the batch
