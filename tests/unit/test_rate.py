"""--rate replay and the online batch-closing rule: budget, row cap, timeout (on a fake clock)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hpcinfer.config import PlanConfig
from hpcinfer.errors import ConfigError
from hpcinfer.files.arrivals import ArrivalReplay, slice_block
from hpcinfer.obs.latency import LatencyLog
from hpcinfer.pipeline.plan import Planner, TokenBudget
from hpcinfer.pipeline.types import TokenBlock
from hpcinfer.types import Reject, RowBlock

from ..conftest import run_job, small_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += int(ms * 1e6)


def token_block(block_id: int, first_row: int, lengths: list[int], arrival_ns: list[int] | None = None) -> TokenBlock:
    lens = np.asarray(lengths, dtype=np.int32)
    return TokenBlock(
        block_id,
        first_row,
        len(lengths),
        [f"r{first_row + k}" for k in range(len(lengths))],
        np.ones(int(lens.sum()), dtype=np.int32),
        lens,
        rows=np.arange(first_row, first_row + len(lengths), dtype=np.int64),
        arrival_ns=None if arrival_ns is None else np.asarray(arrival_ns, dtype=np.int64),
    )


def online_planner(clock: FakeClock, tokens: int = 64, rows: int = 100, timeout_ms: float | None = 10) -> Planner:
    cfg = PlanConfig(sort_window=10_000, max_batch_tokens=tokens, max_batch_size=rows, pad_multiple=8)
    return Planner(cfg, TokenBudget(tokens, 8), online=True, timeout_ms=timeout_ms, clock=clock)


def feed(planner: Planner, clock: FakeClock, lengths: list[int], start_row: int = 0) -> list[list]:
    """One row per block, one block per millisecond; the batches each block released, by block."""
    released = []
    for k, n in enumerate(lengths):
        released.append(list(planner.process(token_block(k, start_row + k, [n], [clock()]))))
        clock.advance_ms(1)
    return released


def test_closes_on_token_budget():
    clock = FakeClock()
    planner = online_planner(clock, tokens=64)
    # Rows of 20 tokens pad to 24: two fit in 64 tokens, a third would need 72.
    released = feed(planner, clock, [20, 20, 20, 20])
    assert [len(r) for r in released] == [0, 1, 0, 1]
    assert [b.num_rows for b in released[1] + released[3]] == [2, 2]
    assert all(b.padded_tokens <= 64 for b in released[1] + released[3])


def test_closes_on_row_cap():
    clock = FakeClock()
    planner = online_planner(clock, tokens=10_000, rows=3)
    released = feed(planner, clock, [5] * 7)
    assert [len(r) for r in released] == [0, 0, 1, 0, 0, 1, 0]
    assert [b.rows.tolist() for r in released for b in r] == [[0, 1, 2], [0, 1, 2]]
    assert [b.window.first_row for r in released for b in r] == [0, 3]
    assert [b.num_rows for b in planner.finish()] == [1]


def test_closes_on_timeout_of_the_oldest_row():
    clock = FakeClock()
    planner = online_planner(clock, tokens=10_000, timeout_ms=10)
    assert planner.deadline_ns() is None  # nothing waits
    assert feed(planner, clock, [5, 5]) == [[], []]  # arrived at 0 and 1 ms
    assert planner.deadline_ns() == 10_000_000  # the oldest row's arrival + 10 ms
    clock.now = 9_999_999
    assert list(planner.tick()) == []
    clock.now = 10_000_000
    (batch,) = planner.tick()
    assert batch.num_rows == 2 and batch.closed_ns == 10_000_000
    assert batch.window.arrival_ns.tolist() == [0, 1_000_000]
    assert planner.deadline_ns() is None and list(planner.tick()) == []


def test_a_row_that_would_overflow_closes_the_pending_batch_first():
    clock = FakeClock()
    planner = online_planner(clock, tokens=64)
    released = feed(planner, clock, [8, 40])  # 8 pads to 8; with a 40-token row: 2 x 40 = 80 > 64
    assert [b.num_rows for b in released[1]] == [1, 1]  # the short row goes alone, then the long one
    assert [b.padded_len for b in released[1]] == [8, 40]


def test_overfull_arrivals_are_cut_to_the_budget_without_bucket_edges():
    clock = FakeClock()
    planner = online_planner(clock, tokens=64)
    (batches,) = [list(planner.process(token_block(0, 0, [9, 10, 11, 12, 13, 14], [0] * 6)))]
    assert all(b.padded_tokens <= 64 for b in batches)
    assert sorted(r for b in batches for r in b.rows.tolist()) == list(range(6))
    assert [b.num_rows for b in batches] == [4, 2]  # 4 x 16 = 64: lengths 9..16 share one batch


def test_timeout_without_rate_bounds_how_long_rows_wait_for_a_window():
    clock = FakeClock()
    cfg = PlanConfig(sort_window=1000, max_batch_tokens=10_000, max_batch_size=100, pad_multiple=8)
    planner = Planner(cfg, TokenBudget(10_000, 8), timeout_ms=50, clock=clock)
    assert list(planner.process(token_block(0, 0, [5, 6, 7]))) == []  # bulk mode: waits for the window
    assert planner.deadline_ns() == 50_000_000  # timed from when the planner got the rows
    clock.advance_ms(50)
    assert [b.num_rows for b in planner.tick()] == [3]


def test_slices_cover_every_input_row_once():
    block = RowBlock(
        7,
        100,
        6,
        "f.jsonl",
        ["a", "b", "c", "d"],
        texts=["ta", "tb", "tc", "td"],
        rejects=[Reject(100, "f.jsonl", 1, "x", "empty_text", "m"), Reject(103, "f.jsonl", 4, "y", "empty_text", "m")],
        rows=[101, 102, 104, 105],
        lines=[2, 3, 5, 6],
    )
    parts = [slice_block(block, 0, 1, 0), slice_block(block, 1, 3, 1), slice_block(block, 3, 4, 2)]
    assert [(p.first_row, p.input_rows) for p in parts] == [(100, 2), (102, 3), (105, 1)]
    assert [p.texts for p in parts] == [["ta"], ["tb", "tc"], ["td"]]
    assert [[r.row for r in p.rejects] for p in parts] == [[100], [103], []]


def test_replay_releases_requests_at_their_poisson_arrival_times():
    clock = FakeClock()
    slept: list[float] = []

    def wait(seconds: float) -> None:
        slept.append(seconds)
        clock.now += int(seconds * 1e9)

    n = 2000
    block = RowBlock(0, 0, n, "f", [str(i) for i in range(n)], texts=["t"] * n, rows=list(range(n)), lines=[None] * n)
    replay = ArrivalReplay(lambda: iter([block]), rate=100.0, seed=3, clock=clock, wait=wait)
    released = list(replay.produce())
    assert sum(len(b) for b in released) == n
    assert [b.block_id for b in released] == list(range(len(released)))
    arrivals = np.concatenate([b.arrival_ns for b in released])
    gaps = np.diff(arrivals) / 1e9
    assert arrivals[0] == 0 and np.all(gaps >= 0)
    assert 0.0093 < gaps.mean() < 0.0107  # mean gap 1/rate, within ~3.5 sigma for 2000 gaps
    assert np.std(gaps) == pytest.approx(gaps.mean(), rel=0.1)  # exponential: sd == mean
    for b in released:  # nothing released before it arrived, and an idle clock lags nothing
        assert b.arrival_ns.max() <= clock.now
    assert replay.max_lag_ns == 0


def test_latency_summary_tells_kept_up_from_saturated():
    rate = 100.0
    arrivals = np.arange(200, dtype=np.int64) * 10_000_000  # 100/s for 2 s
    kept_up = LatencyLog()
    for a in arrivals:
        kept_up.requests_done(np.array([a]), int(a) + 5_000_000)
    s = kept_up.request_summary(rate)
    assert not s["saturated"] and s["latency_ms"]["p99"] == pytest.approx(5.0)
    assert s["achieved_rate"] == pytest.approx(100, rel=0.02)

    behind = LatencyLog()  # served at 50/s: each request waits for all before it
    for k, a in enumerate(arrivals):
        behind.requests_done(np.array([a]), (k + 1) * 20_000_000)
    s = behind.request_summary(rate)
    assert s["saturated"] and s["achieved_rate"] == pytest.approx(50, rel=0.02)


def test_rate_run_matches_bulk_output_and_reports_latency(tmp_path, tiny_model, requests_jsonl):
    bulk_report, bulk = run_job(small_config(requests_jsonl, tmp_path / "bulk.parquet", tiny_model))
    cfg = small_config(
        requests_jsonl,
        tmp_path / "rate.parquet",
        tiny_model,
        input={"rate": 2000.0, "rate_seed": 1},
        plan={"batch_timeout_ms": 5.0},
    )
    report, table = run_job(cfg)
    assert table.column("id").to_pylist() == bulk.column("id").to_pylist()
    got = np.asarray(table.column("embedding").to_pylist())
    want = np.asarray(bulk.column("embedding").to_pylist())
    np.testing.assert_allclose(got, want, atol=1e-5)  # other batches, same rows
    assert report.arrivals["latency_ms"]["p99"] > 0 and report.arrivals["offered_rate"] > 0
    assert report.batch_latency_ms["p50"] > 0 and bulk_report.arrivals == {}
    assert report.windows > bulk_report.windows  # windows close by budget or timeout, not by size


def test_rate_above_capacity_is_reported_saturated(tmp_path, tiny_model, requests_jsonl):
    cfg = small_config(requests_jsonl, tmp_path / "sat.parquet", tiny_model, input={"rate": 5000.0})
    # Each batch takes 30 ms: about 33 batches/s of at most 32 rows, far below 5000 rows/s at 1 ms timeouts.
    report, table = run_job(cfg, hooks={"execute": lambda _item: time.sleep(0.03)})
    assert report.arrivals["saturated"]
    assert len(table) == 300


def test_rate_needs_the_overlapped_pipeline(tmp_path, tiny_model, requests_jsonl):
    cfg = small_config(
        requests_jsonl, tmp_path / "x.parquet", tiny_model, input={"rate": 10.0}, pipeline={"overlap": False}
    )
    with pytest.raises(ConfigError, match="--rate needs the overlapped pipeline"):
        run_job(cfg)
