"""Several devices on one machine: dispatch by outstanding tokens, output as from one device."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from hpcinfer.api import run
from hpcinfer.device.base import DeviceOutOfMemory
from hpcinfer.device.simulated import SimulatedDevice
from hpcinfer.errors import ConfigError, DevicesFailed
from hpcinfer.obs.progress import Progress
from hpcinfer.place.devices import device_labels, parse_devices
from hpcinfer.place.dispatch import Dispatcher

from ..conftest import make_texts, read_output, run_job, small_config, windows_committed, write_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
CRASH_RUN = Path(__file__).with_name("crash_run.py")


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("devices")
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(1500, seed=11))]
    rows[5]["text"] = ""
    return write_jsonl(tmp / "in.jsonl", rows)


@pytest.fixture(scope="module")
def one_device(rows_file, tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "out.parquet"
    _, table = run_job(small_config(rows_file, out, tiny_model))
    return table


def _pair(slow: float = 1.0, fast: float = 3.0, per_token: float = 4e-5) -> list[SimulatedDevice]:
    return [
        SimulatedDevice(seed=k, max_delay_s=0.0005, seconds_per_token=per_token, speed=speed)
        for k, speed in enumerate((slow, fast))
    ]


def test_a_three_times_faster_device_gets_three_quarters_of_the_tokens(tiny_model, tmp_path):
    # NOTE: the simulated delay per token dominates the real (unscaled) compute of the tiny model,
    # so the pair really is about 1x and 3x.
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(800, seed=2))])
    plan = {"max_batch_tokens": 512, "sort_window": 800}
    _, one_device = run_job(small_config(src, tmp_path / "one.parquet", tiny_model, plan=plan))
    devices = _pair(per_token=3e-4)
    try:
        report, table = run_job(small_config(src, tmp_path / "out.parquet", tiny_model, plan=plan), devices=devices)
    finally:
        for d in devices:
            d.close()
    slow, fast = report.devices
    assert (slow["device"], fast["device"]) == ("simulated#0", "simulated#1")
    # NOTE: each device's time per token is its simulated delay d (slow) or d/3 (fast) plus the same
    # real compute c, so the fast share is (1/(c+d/3)) / (1/(c+d) + 1/(c+d/3)): 0.75 at c = 0, 0.67
    # at c = d/3 (a busy machine slows the real compute, never the simulated delay)
    assert 0.65 <= fast["token_share"] <= 0.80, report.devices
    ends = [slow["finished_s"], fast["finished_s"]]
    assert abs(ends[0] - ends[1]) <= 0.10 * max(ends), report.devices  # both finish within 10%
    assert table.column("id").to_pylist() == one_device.column("id").to_pylist()
    assert table.column("embedding").equals(one_device.column("embedding"))


@pytest.mark.parametrize("overlap", [True, False])
def test_two_cpu_replicas_give_the_one_device_output_bit_for_bit(rows_file, tiny_model, tmp_path, one_device, overlap):
    cfg = small_config(
        rows_file, tmp_path / "out.parquet", tiny_model, device={"devices": "cpu,cpu"}, pipeline={"overlap": overlap}
    )
    report, table = run_job(cfg)
    assert table.equals(one_device)
    assert [d["device"] for d in report.devices] == ["cpu#0", "cpu#1"]
    assert all(d["batches"] > 0 for d in report.devices)
    assert report.accounting["rows_written"] == 1499
    assert report.device_faults == [] and report.restarts == []  # the empty row is a reject, not a fault


class _FailingDevice(SimulatedDevice):
    """A device that breaks down after a number of forwards, as a GPU that falls off the bus; with
    `ready`, at its first forward after that once `ready()` holds (not before: it works on)."""

    def __init__(self, after: int, ready: Callable[[], bool] = lambda: True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.after = after
        self.ready = ready

    def before_forward(self, rows: int, width: int) -> None:
        self.after -= 1
        if self.after < 0 and self.ready():
            raise RuntimeError("device lost")
        super().before_forward(rows, width)

    def renew(self) -> _FailingDevice:
        self.close()
        return _FailingDevice(0, seed=self._settings["seed"], max_delay_s=0.0005)  # broken for good


def test_a_device_that_fails_for_good_leaves_the_run_to_the_others(rows_file, tiny_model, tmp_path, one_device):
    out = tmp_path / "out.parquet"
    # NOTE: it fails once a window is committed, so the restart has rows to resume however busy
    # the machine (with a bare count of forwards, a starved writer had committed none yet)
    devices = [
        SimulatedDevice(seed=0, max_delay_s=0.0005),
        _FailingDevice(after=8, ready=lambda: windows_committed(out) > 0, seed=1, max_delay_s=0.0005),
        SimulatedDevice(seed=2, max_delay_s=0.0005),
    ]
    stream = io.StringIO()
    trace = tmp_path / "trace.json"
    try:
        report = run(
            small_config(rows_file, out, tiny_model, trace_path=str(trace)),
            devices=devices,
            progress=Progress("log", stream),
        )
    finally:
        for d in devices:
            d.close()
    table = read_output(str(out))
    assert table.equals(one_device)  # bit for bit: the uncommitted windows were redone on the others
    assert [(t["device"], t["state"]) for t in report.device_faults] == [("simulated#1", "open")]
    assert [r["device"] for r in report.restarts] == ["simulated#1", "simulated#1"]  # it failed twice
    assert "device lost" in report.restarts[0]["error"] and "device simulated#1 open" in stream.getvalue()
    events = json.loads(trace.read_text())["traceEvents"]  # the transition is a mark on the device's track
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    marks = [(e["name"], tracks[e["tid"]]) for e in events if e["name"].startswith("breaker")]
    assert ("breaker open", "simulated#1/breaker") in marks
    assert any(e["name"] == "execute" for e in events)  # with the stages' spans
    books = report.accounting  # NOTE: rows committed before a restart are the restart's resumed rows
    assert books["rows_written"] + books["rows_rejected"] + books["rows_resumed"] == books["rows_read"] == 1500
    assert report.rows_resumed == books["rows_resumed"] > 0 and table.num_rows == 1499


class _FailsTwice(SimulatedDevice):
    """Fails at a forward of each of two runs, then is a healthy device again (renewed: its streams
    fresh, the count kept)."""

    def __init__(self, after: int, failed: list[int] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.after, self.failed = after, failed if failed is not None else [0]

    def before_forward(self, rows: int, width: int) -> None:
        self.after -= 1
        if self.after < 0 and self.failed[0] < 2:
            self.failed[0] += 1
            raise RuntimeError("transient fault")
        super().before_forward(rows, width)

    def renew(self) -> _FailsTwice:
        self.close()
        return _FailsTwice(0, self.failed, seed=1, max_delay_s=0.0005)


def test_a_device_that_recovers_is_back_after_the_cooldown(rows_file, tiny_model, tmp_path, one_device):
    out = tmp_path / "out.parquet"
    devices = [SimulatedDevice(seed=0, max_delay_s=0.0005), _FailsTwice(after=30, seed=1, max_delay_s=0.0005)]
    cfg = small_config(rows_file, out, tiny_model, device={"breaker_cooldown": 0.0})
    try:
        report, table = run_job(cfg, devices=devices)
    finally:
        for d in devices:
            d.close()
    assert table.equals(one_device)
    states = [(t["device"], t["state"]) for t in report.device_faults]
    assert states == [("simulated#1", "open"), ("simulated#1", "half-open"), ("simulated#1", "closed")], states
    assert len(report.restarts) == 2
    assert report.devices[1]["batches"] > 0  # it worked again after the cool-down


class _HangsAt(SimulatedDevice):
    """A forward that never comes back (until the test releases it)."""

    def __init__(self, at: int, release: threading.Event, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at, self.release = at, release

    def before_forward(self, rows: int, width: int) -> None:
        self.at -= 1
        if self.at == 0:
            self.release.wait(60)
        super().before_forward(rows, width)


def test_a_hung_device_is_given_up_after_the_step_timeout(rows_file, tiny_model, tmp_path, one_device):
    release = threading.Event()
    devices = [SimulatedDevice(seed=0, max_delay_s=0.0005), _HangsAt(8, release, seed=1, max_delay_s=0.0005)]
    cfg = small_config(rows_file, tmp_path / "out.parquet", tiny_model, device={"step_timeout": 1.0})
    started = time.perf_counter()
    try:
        report, table = run_job(cfg, devices=devices)
    finally:
        release.set()
        for d in devices:
            d.close()
    assert time.perf_counter() - started < 30  # nothing waited for the hung forward
    assert table.equals(one_device)
    assert [(t["device"], t["state"]) for t in report.device_faults] == [("simulated#1", "open")]
    assert "DeviceHung: no batch finished in 1 s" in report.restarts[0]["error"]


def test_every_device_failing_names_each_and_committed_windows_resume(rows_file, tiny_model, tmp_path, one_device):
    out = tmp_path / "out.parquet"
    devices = [_FailingDevice(after=30, seed=k, max_delay_s=0.0005) for k in range(2)]
    try:
        with pytest.raises(
            DevicesFailed,
            match=r"every device failed: device@simulated#0: RuntimeError: device "
            r"lost; device@simulated#1: RuntimeError: device lost",
        ):
            run_job(small_config(rows_file, out, tiny_model), devices=devices)
    finally:
        for d in devices:
            d.close()
    manifest = json.loads((Path(f"{out}.parts") / "manifest.json").read_text())
    assert manifest["windows"], "windows committed before the failures are kept"
    report, table = run_job(small_config(rows_file, out, tiny_model, output={"resume": True}))
    assert report.rows_resumed == sum(w["input_rows"] for w in manifest["windows"]) > 0
    assert table.equals(one_device)


def test_kill_9_and_resume_across_two_devices(rows_file, tiny_model, tmp_path, one_device):
    out = tmp_path / "killed.parquet"
    args = [str(rows_file), "-o", str(out), "--model", str(tiny_model), "--devices", "cpu,cpu"]
    args += ["--sort-window", "120", "--max-batch-tokens", "1024", "--max-batch-size", "32", "--progress", "off", "-q"]
    killed = subprocess.run(
        [sys.executable, str(CRASH_RUN), "manifest_renamed", "4", *args], env=ENV, capture_output=True, timeout=300
    )
    assert killed.returncode == -9
    done = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", *args, "--resume"], env=ENV, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert pq.read_table(out).equals(one_device)


def test_device_lists():
    assert parse_devices("cuda:0,cuda:1", cuda_count=2) == ["cuda:0", "cuda:1"]
    assert parse_devices("all", cuda_count=3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert parse_devices("cpu,cpu", cuda_count=0) == ["cpu", "cpu"]
    with pytest.raises(ConfigError, match="cuda:0 is listed 2 times; one replica per GPU"):
        parse_devices("cuda:0,cuda", cuda_count=1)
    with pytest.raises(ConfigError, match="--devices all: no CUDA device"):
        parse_devices("all", cuda_count=0)
    with pytest.raises(ConfigError, match="'tpu' is not a device"):
        parse_devices("cpu,tpu", cuda_count=0)
    assert device_labels(["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1"]
    assert device_labels(["cpu", "cpu"]) == ["cpu#0", "cpu#1"]


def test_the_cli_refuses_one_gpu_listed_twice(tmp_path, rows_file):
    done = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", str(rows_file), "-o", str(tmp_path / "o.parquet")]
        + ["--devices", "cuda:0,cuda:0"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "cuda:0 is listed 2 times; one replica per GPU" in done.stderr
    assert "Traceback" not in done.stderr


def _simulate(policy: str, batch_tokens: list[int], speeds: list[float], depth: int = 4) -> list[float]:
    """A discrete-event model of the pipeline's dispatch: each device runs its queue in order, the
    dispatcher blocks while the chosen device holds `depth` batches. Returns each device's finish time."""
    dispatcher = Dispatcher(len(speeds), policy)
    queues: list[list[tuple[float, int]]] = [[] for _ in speeds]  # (finish time, tokens) per queued batch
    busy_until = [0.0] * len(speeds)
    now = 0.0

    def written(device: int) -> None:
        finish, tokens = queues[device].pop(0)
        dispatcher.done(device, tokens, tokens / speeds[device])

    for tokens in batch_tokens:
        device = dispatcher.choose(tokens)
        while len(queues[device]) >= depth:  # wait for its oldest batch to be done
            now = max(now, queues[device][0][0])
            written(device)
        for d, q in enumerate(queues):  # results written meanwhile leave the counts
            while q and q[0][0] <= now:
                written(d)
        busy_until[device] = max(busy_until[device], now) + tokens / speeds[device]
        queues[device].append((busy_until[device], tokens))
    return busy_until


def test_dispatch_by_tokens_adapts_to_speed_and_to_skewed_batches():
    rng = np.random.default_rng(0)
    skewed = [int(t) for t in rng.choice([64, 256, 2048], size=400, p=[0.6, 0.3, 0.1])]
    for speeds in ([1.0, 1.0], [1.0, 3.0]):
        by_tokens = _simulate("tokens", skewed, speeds)
        round_robin = _simulate("round_robin", skewed, speeds)
        assert max(by_tokens) < max(round_robin), speeds  # the run ends sooner
    by_tokens, round_robin = _simulate("tokens", skewed, [1.0, 3.0]), _simulate("round_robin", skewed, [1.0, 3.0])
    assert max(by_tokens) - min(by_tokens) < max(round_robin) - min(round_robin)  # a shorter idle tail
    ideal = sum(skewed) / 4  # the pair does 4 tokens per unit of time
    assert max(by_tokens) < 1.05 * ideal


def test_progress_shows_rows_per_device():
    progress = Progress("log", stream=io.StringIO())
    progress.set_devices(["cuda:0", "cuda:1"])
    progress.advance(10, 100, device=1)
    progress.advance(4, 40, device=0)
    assert progress.line(1.0).endswith("[cuda:0 4, cuda:1 10]")


class _OomAbove(SimulatedDevice):
    """A device whose allocator 'fails' for forwards above a token count."""

    def __init__(self, limit_tokens: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.limit = limit_tokens
        self.failures = 0

    def before_forward(self, rows: int, width: int) -> None:
        if rows * width > self.limit:
            self.failures += 1
            raise DeviceOutOfMemory(f"injected: {rows} x {width}")


def test_out_of_memory_is_split_on_the_device_that_ran_out(rows_file, tiny_model, tmp_path, one_device):
    small = _OomAbove(300, seed=1, max_delay_s=0.0005)
    devices = [SimulatedDevice(seed=0, max_delay_s=0.0005), small]
    try:
        report, table = run_job(small_config(rows_file, tmp_path / "out.parquet", tiny_model), devices=devices)
    finally:
        for d in devices:
            d.close()
    assert small.failures > 0 and report.oom_splits > 0
    assert np.allclose(
        np.asarray(table.column("embedding").to_pylist()),
        np.asarray(one_device.column("embedding").to_pylist()),
        atol=1e-5,
    )
    assert table.column("id").to_pylist() == one_device.column("id").to_pylist()


def test_an_error_on_a_simulated_stream_is_sticky_as_on_cuda():
    """Work after a failure never runs and every later event raises it: no result of a failed batch
    can look finished (which let a window of garbage be committed)."""
    device = SimulatedDevice(max_delay_s=0.0)
    stream = device.compute_streams[0]
    ran, gate = [], threading.Event()

    def failing_kernel() -> None:
        gate.wait()  # NOTE: fails only once the later work is queued behind it
        raise RuntimeError("kernel failed")

    try:
        stream.launch(failing_kernel)
        stream.launch(lambda: ran.append("later"))
        done = stream.record()
        gate.set()
        with pytest.raises(RuntimeError, match="kernel failed"):
            done.synchronize()
        assert ran == []
        with pytest.raises(RuntimeError, match="kernel failed"):
            stream.launch(lambda: None)  # and the host hears of it at the next launch
    finally:
        device.close()
