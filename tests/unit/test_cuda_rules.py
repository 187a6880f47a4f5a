"""CUDA's rules, checked without a GPU: on the simulated device (which enforces them) and on the CPU.

Each test stands for one way the CUDA path would crash or corrupt on its first real run: graph
capture while other threads synchronize, graph outputs shared by the two halves of an
out-of-memory split, graph padding past the token budget, device times read from a buffer already
reused, padded widths past the model's positions, worker threads without a current device, and
event clocks that lose resolution.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from hpcinfer.device.base import DeviceOutOfMemory, OutputPool
from hpcinfer.device.clock import EventClock
from hpcinfer.device.graphs import GraphRunner, graph_widths, row_buckets
from hpcinfer.device.simulated import CudaRuleBroken, SimulatedDevice
from hpcinfer.pipeline.plan import cut_batches, max_padded_len
from tests.fixtures.tiny import build_tiny_bert

from ..conftest import make_texts, run_job, small_config, write_jsonl


def _emb(table) -> np.ndarray:
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)


class OomOnce(SimulatedDevice):
    """The simulated device, whose allocator 'fails' the first forward only (a transient shortage)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.failed: list[tuple[int, int]] = []

    def before_forward(self, rows: int, width: int) -> None:
        if not self.failed:
            self.failed.append((rows, width))
            raise DeviceOutOfMemory(f"injected: {rows} x {width}")


@pytest.fixture()
def runners(monkeypatch) -> list[GraphRunner]:
    """Every GraphRunner built during the test."""
    built: list[GraphRunner] = []
    original = GraphRunner.__init__

    def init(self, *args, **kwargs) -> None:  # noqa: ANN001
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(GraphRunner, "__init__", init)
    return built


def _graph_config(requests_jsonl, out, tiny_model, max_length=96, **plan):
    return small_config(
        requests_jsonl,
        out,
        tiny_model,
        tokenize={"max_length": max_length},
        plan={"sort_window": 120, "max_batch_tokens": 1024, "max_batch_size": 32, **plan},
        device={"device": "simulated", "cuda_graphs": True},
    )


def _eager(cfg) -> np.ndarray:
    """The same job eagerly on the CPU, serially: the reference."""
    cfg = replace(cfg, device=replace(cfg.device, device="cpu", cuda_graphs=False))
    cfg = replace(cfg, output=replace(cfg.output, path=cfg.output.path + ".eager.parquet"))
    return _emb(run_job(replace(cfg, pipeline=replace(cfg.pipeline, overlap=False)))[1])


# --------------------------------------------------------------------------- 1. capture up front


def test_a_capture_forbids_event_synchronization_from_other_threads():
    device = SimulatedDevice()
    event = device.copy_stream.record()
    event.synchronize()
    seen: list[BaseException] = []

    def other_thread() -> None:
        try:
            event.synchronize()
        except CudaRuleBroken as exc:
            seen.append(exc)

    def forward() -> torch.Tensor:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        return torch.zeros(1)

    device.capture(forward, device.graph_pool())
    assert seen and "while a graph is being captured" in str(seen[0])
    event.synchronize()  # outside a capture, or from the capturing thread itself, it is allowed
    device.close()


def test_a_capture_begun_while_another_thread_waits_is_refused():
    device = SimulatedDevice(max_delay_s=0.0)
    gate = threading.Event()
    device.compute_streams[0].launch(gate.wait)
    pending = device.compute_streams[0].record()
    waiter = threading.Thread(target=pending.synchronize)
    waiter.start()
    while not device._waiters:  # noqa: SLF001 - the waiter is blocked in synchronize
        threading.Event().wait(0.001)
    with pytest.raises(CudaRuleBroken, match="capture began while"):
        device.capture(lambda: torch.zeros(1), device.graph_pool())
    gate.set()
    waiter.join()
    device.close()


def test_graphs_are_captured_before_the_stage_threads_start(tmp_path, tiny_model, requests_jsonl, runners):
    cfg = _graph_config(requests_jsonl, tmp_path / "g.parquet", tiny_model)
    cfg = replace(cfg, device=replace(cfg.device, streams=2))
    device = SimulatedDevice(streams=2)
    try:
        report, table = run_job(cfg, device=device)
    finally:
        device.close()
    np.testing.assert_allclose(_emb(table), _eager(cfg), rtol=1e-5, atol=1e-6)
    (runner,) = runners
    assert {thread for thread, _ in device.captures} == {threading.main_thread().name}
    assert runner.replays == report.batches and runner.eager == 0  # every batch replayed a graph


# --------------------------------------------------------------------------- 2. out-of-memory split


def test_an_out_of_memory_split_with_graphs_gives_each_half_its_own_rows(tmp_path, tiny_model, requests_jsonl, runners):
    # 16-row batches at width 64: the first fails, its halves (8 rows each) replay the same graph
    cfg = _graph_config(requests_jsonl, tmp_path / "g.parquet", tiny_model, max_length=64, max_batch_size=16)
    device = OomOnce()
    try:
        report, table = run_job(cfg, device=device)
    finally:
        device.close()
    assert device.failed == [(16, 64)] and report.oom_splits == 1
    (runner,) = runners
    assert runner.padded_rows(8, 64) == 8 and report.final_max_batch_tokens >= 8 * 64  # halves replay (8, 64)
    np.testing.assert_allclose(_emb(table), _eager(cfg), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 3. budget and memory


def test_graph_buckets_never_break_the_token_budget():
    # sample_data on CUDA: 146 rows at width 80, budget 16,384: a power-of-two bucket (256) would hold 20,480
    buckets = row_buckets(80, 16_384, 512)
    assert min(b for b in buckets if b >= 146) * 80 <= 16_384
    for width in graph_widths(256, 8):
        for max_rows in (1, 7, 64, 512):
            buckets = row_buckets(width, 16_384, max_rows)
            assert buckets == sorted(set(buckets)) and buckets[-1] == min(max_rows, 16_384 // width)
            assert all(b * width <= 16_384 for b in buckets)


def test_out_of_memory_lowers_the_budget_by_the_padded_tokens_that_ran(tmp_path, tiny_model, runners):
    # the longest rows are 3 of 62 tokens: the first batch is 3 rows at width 64, replayed as the 4-row graph
    short = [t for t in make_texts(200, seed=5) if len(t.split()) <= 20]
    texts = [" ".join(["fox"] * 60)] * 3 + short[:100]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    device = OomOnce()
    try:
        report, _ = run_job(_graph_config(src, tmp_path / "g.parquet", tiny_model), device=device)
    finally:
        device.close()
    (runner,) = runners
    assert 4 in runner.grid[64]
    assert device.failed == [(4, 64)]  # what failed is what ran: 4 rows, not the batch's 3
    assert report.final_max_batch_tokens == 4 * 64 // 2


def test_each_stream_shares_one_graph_pool_and_frees_it(tmp_path, tiny_model, requests_jsonl, runners):
    cfg = _graph_config(requests_jsonl, tmp_path / "g.parquet", tiny_model)
    device = SimulatedDevice(streams=2)
    try:
        run_job(replace(cfg, device=replace(cfg.device, streams=2)), device=device)
    finally:
        device.close()
    (runner,) = runners
    assert len(device.pools) == 2  # one per compute stream: two streams replay concurrently
    per_stream = len(device.captures) // 2
    assert [pool for _, pool in device.captures] == [device.pools[0]] * per_stream + [device.pools[1]] * per_stream
    assert all(rows * width <= 1024 for width, buckets in runner.grid.items() for rows in buckets)
    assert runner.captured == 0  # closed at the end of the run


def test_graphs_of_one_capture_lane_replayed_on_two_streams_break_the_workspace_rule():
    device = SimulatedDevice(streams=2, max_delay_s=0.0)
    pool = device.graph_pool()
    graphs = [device.capture(lambda: torch.zeros(1), pool, lane=0)[0] for _ in range(2)]
    errors: list[BaseException] = []

    def replay_on(stream, graph) -> None:  # noqa: ANN001
        try:
            graph.replay()
        except CudaRuleBroken as exc:
            errors.append(exc)

    for stream, graph in zip(device.compute_streams, graphs, strict=True):
        stream.launch(lambda s=stream, g=graph: replay_on(s, g))
    device.synchronize()
    device.close()
    assert len(errors) == 1 and "cuBLAS workspace" in str(errors[0])


def test_each_stream_captures_its_graphs_on_a_lane_of_its_own(tmp_path, tiny_model, requests_jsonl, runners):
    cfg = _graph_config(requests_jsonl, tmp_path / "g.parquet", tiny_model)
    device = SimulatedDevice(streams=2)
    try:
        report, table = run_job(replace(cfg, device=replace(cfg.device, streams=2)), device=device)
    finally:
        device.close()
    np.testing.assert_allclose(_emb(table), _eager(cfg), rtol=1e-5, atol=1e-6)
    assert report.batches >= 4
    # both streams replayed graphs, each through the workspace of its own capture lane
    assert device._workspace_users == {0: "sim-compute0", 1: "sim-compute1"}


# --------------------------------------------------------------------------- 4. events of a reused buffer


def test_events_of_a_reused_output_buffer_cannot_be_read():
    device = SimulatedDevice(max_delay_s=0.0)
    pool = OutputPool(device, 1, 4, 8)
    buf = pool.acquire()
    buf.events = {"d2h_done": device.compute_streams[0].record()}
    buf.events["d2h_done"].synchronize()
    old = buf.events
    assert old["d2h_done"].time_ns() > 0
    pool.release(buf)
    pool.acquire()
    with pytest.raises(CudaRuleBroken, match="handed to another batch"):
        old["d2h_done"].time_ns()
    device.close()


def test_device_spans_are_read_before_the_output_buffer_goes_back(tmp_path, tiny_model, requests_jsonl):
    trace = tmp_path / "trace.json"
    cfg = replace(small_config(requests_jsonl, tmp_path / "o.parquet", tiny_model), trace_path=str(trace))
    device = SimulatedDevice(max_delay_s=0.003)
    try:
        report, _ = run_job(cfg, device=device)
    finally:
        device.close()
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for stage in ("h2d", "compute", "d2h"):
        mine = sorted(e["args"]["batch"] for e in spans if e["name"] == stage)
        assert mine == list(range(report.batches)), stage
    by_batch = {(e["name"], e["args"]["batch"]): e for e in spans if e["name"] in ("h2d", "compute", "d2h")}
    execute = {e["args"]["batch"]: e for e in spans if e["name"] == "execute"}
    for b in range(report.batches):
        h2d, compute, d2h = (by_batch[(s, b)] for s in ("h2d", "compute", "d2h"))
        # each batch's own device work: issued by its execute step, in stream order
        assert execute[b]["ts"] <= compute["ts"] + compute["dur"] <= d2h["ts"] + d2h["dur"]
        assert h2d["ts"] + h2d["dur"] <= compute["ts"] + 1e-3


# --------------------------------------------------------------------------- 5. padded width vs positions


def test_padded_widths_never_pass_the_models_positions():
    assert max_padded_len(90, 48, 90) == 90 and max_padded_len(256, 48, 512) == 288
    lengths = np.array([90, 89, 50, 48, 47, 3], dtype=np.int32)
    for pad in (1, 8, 48, 64):
        widths = [w for _, w in cut_batches(lengths, 1000, 4, pad, max_width=max_padded_len(90, pad, 90))]
        assert max(widths) <= 90


def test_a_pad_multiple_past_the_positions_runs(tmp_path):
    model = build_tiny_bert(tmp_path / "short", max_positions=90, max_seq_length=90)
    texts = make_texts(80, seed=3) + [" ".join(["fox"] * 120)]  # truncated to 90 tokens
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    outs = {}
    for pad in (1, 48):
        cfg = small_config(src, tmp_path / f"p{pad}.parquet", model, plan={"pad_multiple": pad, "sort_window": 120})
        outs[pad] = _emb(run_job(cfg)[1])
    np.testing.assert_allclose(outs[48], outs[1], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 6. current device per thread


def test_work_from_a_thread_without_the_current_device_is_refused():
    device = SimulatedDevice()
    failures: list[BaseException] = []

    def unbound() -> None:
        try:
            device.compute_streams[0].record()
        except CudaRuleBroken as exc:
            failures.append(exc)

    t = threading.Thread(target=unbound, name="worker")
    t.start()
    t.join()
    assert failures and "'worker'" in str(failures[0])
    device.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_every_stage_thread_makes_the_device_current(tmp_path, tiny_model, requests_jsonl, overlap):
    cfg = small_config(
        requests_jsonl, tmp_path / "o.parquet", tiny_model, tokenize={"threads": 2}, pipeline={"overlap": overlap}
    )
    device = SimulatedDevice()
    try:
        run_job(cfg, device=device)
    finally:
        device.close()
    if overlap:
        assert {"read", "plan", "stage", "execute", "write"} <= device.bound_threads
        assert any(name.startswith("tokenize_") for name in device.bound_threads)  # the tokenizer pool too
    else:
        assert threading.current_thread().name in device.bound_threads


# --------------------------------------------------------------------------- 7. clocks and blocking waits


class _FakeDeviceClock:
    """A device timeline in exact nanoseconds whose elapsed times come back as float32 ms, like CUDA's."""

    def __init__(self) -> None:
        self.now = 10**9  # host ns; the device is 5 ms behind
        self.offset = -5_000_000

    def event(self, host_ns: int) -> int:
        return host_ns + self.offset

    def elapsed_ms(self, a: int, b: int) -> float:
        return float(np.float32((b - a) / 1e6))


@pytest.mark.parametrize(("renew_ns", "exact"), [(1e9, True), (float("inf"), False)])
def test_event_times_keep_microseconds_after_an_hour(renew_ns, exact):
    fake = _FakeDeviceClock()
    clock = EventClock(lambda: fake.event(fake.now), fake.elapsed_ms, lambda: fake.now, renew_ns=renew_ns)
    errors = []
    for second in range(0, 3600, 7):
        fake.now = 10**9 + second * 10**9 + 123_457
        done_at = fake.now - 250_000  # a d2h that completed a quarter of a millisecond ago
        errors.append(abs(clock.to_host_ns(fake.event(done_at)) - done_at))
    if exact:  # renewed references: sub-microsecond all hour long
        assert max(errors) < 1_000 and clock.renewals > 100
    else:  # one reference from the start (the scheme this replaced): tens of microseconds and worse
        assert max(errors) > 50_000


def test_cuda_events_block_instead_of_spinning(monkeypatch):
    import hpcinfer.device.cuda as cuda

    made: list[dict] = []

    class Recorder:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def record(self, stream) -> None:  # noqa: ANN001
            return None

    monkeypatch.setattr(cuda.torch.cuda, "Event", Recorder)
    stream = object.__new__(cuda.CudaStream)
    stream._stream, stream._clock = object(), None  # noqa: SLF001
    stream.record()
    assert made == [{"enable_timing": True, "blocking": True}]
