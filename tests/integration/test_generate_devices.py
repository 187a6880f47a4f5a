"""Generation on several devices: `--devices cpu,cpu` writes what one device writes, byte for byte
(greedy, seeded and unseeded sampling, priorities, rejects); dispatch by outstanding tokens gives a
slowed engine less; a failing engine names its device and its committed windows resume; kill -9
and --resume across two devices."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.engine.runtime.pool import EnginePool
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.errors import ConfigError, DevicesFailed
from hpcinfer.obs.profile import RecordingRanges
from hpcinfer.obs.progress import Progress
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, write_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
CRASH_RUN = Path(__file__).with_name("crash_run.py")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("gendev"), "Qwen2ForCausalLM", seed=4, max_positions=128)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    rows = []
    for i, t in enumerate(make_texts(48, seed=21)):
        row = {"id": f"r{i}", "prompt": t, "max_tokens": 2 + (i * 5) % 11, "priority": i % 3}
        if i % 3 == 1:
            row.update(temperature=0.9, top_p=0.9, seed=i)
        elif i % 3 == 2:
            row.update(temperature=1.0)  # unseeded: the run seed and the row number decide
        rows.append(row)
    rows[7]["top_k"] = -1
    rows[30]["prompt"] = " ".join(["fox"] * 200)  # too long
    return write_jsonl(tmp_path_factory.mktemp("gendev_in") / "in.jsonl", rows)


def config(src: Path, out: Path, model: Path, devices: str | None = None, **over) -> RunConfig:
    return RunConfig(
        input=InputConfig((str(src),)),
        model=str(model),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(devices=devices),
        generate=GenerateConfig(max_tokens=8, window_rows=5, kv_cache_memory="8MiB", max_num_seqs=4),
        **over,
    )


def _texts(out: Path) -> tuple[str, str]:
    return out.read_text(), Path(f"{out}.rejects.jsonl").read_text()


@pytest.fixture(scope="module")
def one_device(rows_file, ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("gendev_one") / "out.jsonl"
    report = run_generate(config(rows_file, out, ckpt))
    return _texts(out), report


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_cpu_affinity_pins_the_engine_and_the_tokenizing_thread(rows_file, ckpt, tmp_path, one_device, monkeypatch):
    """--cpu-affinity B/A: the requests are read and tokenized on a thread of their own on core A,
    the engine steps on core B with one torch thread, and the answers are the unpinned run's."""
    from hpcinfer.tasks.generate.requests import RequestReader

    (want, want_rejects), _ = one_device
    a, b = sorted(os.sched_getaffinity(0))[:2]
    read_on: set[tuple[str, tuple[int, ...]]] = set()
    request = RequestReader._request

    def recorded(self, *args):  # noqa: ANN001, ANN202
        read_on.add((threading.current_thread().name, tuple(os.sched_getaffinity(0))))
        return request(self, *args)

    monkeypatch.setattr(RequestReader, "_request", recorded)
    stepped_on: set[tuple[tuple[int, ...], int]] = set()
    import torch

    def step() -> None:
        stepped_on.add((tuple(os.sched_getaffinity(0)), torch.get_num_threads()))
        # every other thread of the process too (torch's OpenMP workers among them), but the tokenizer's
        tokenizing = {t.native_id for t in threading.enumerate() if t.name == "tokenize"}
        for tid in os.listdir("/proc/self/task"):
            if int(tid) not in tokenizing:
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    stepped_on.add((tuple(os.sched_getaffinity(int(tid))), torch.get_num_threads()))

    out = tmp_path / "out.jsonl"
    cfg = config(rows_file, out, ckpt)
    cfg = replace(cfg, device=replace(cfg.device, cpu_affinity=f"{b}/{a}"))
    mine = os.sched_getaffinity(0)
    report = run_generate(cfg, step_hooks={"cpu": step})
    assert _texts(out) == (want, want_rejects)
    assert read_on == {("tokenize", (a,))}
    assert stepped_on == {((b,), 1)}
    assert report.cpu_affinity == f"compute on {b}, tokenizer on {a}, host stages on {a}"
    assert os.sched_getaffinity(0) == mine  # the caller's thread is given back its cores


@pytest.mark.parametrize("dispatch", ["tokens", "round_robin"])
def test_two_cpu_engines_write_the_one_device_output_byte_for_byte(rows_file, ckpt, tmp_path, one_device, dispatch):
    (want, want_rejects), one = one_device
    out = tmp_path / "out.jsonl"
    cfg = config(rows_file, out, ckpt, "cpu,cpu")
    cfg = replace(cfg, device=replace(cfg.device, dispatch=dispatch), trace_path=str(tmp_path / "trace.json"))
    progress = Progress("off")
    report = run_generate(cfg, progress=progress)
    assert _texts(out) == (want, want_rejects)
    assert report.rejects == one.rejects == {"invalid_sampling": 1, "too_long": 1}
    assert report.device_faults == [] and report.moved_prompts == {}  # bad rows are rejects, not device faults
    assert report.device == "cpu#0, cpu#1"
    devices = report.devices
    assert [d["device"] for d in devices] == ["cpu#0", "cpu#1"]
    assert all(d["rows"] > 0 and d["steps"] > 0 for d in devices), devices
    assert sum(d["rows"] for d in devices) == report.rows == 46
    assert sum(d["completion_tokens"] for d in devices) == report.completion_tokens == one.completion_tokens
    assert sum(d["prompt_tokens"] for d in devices) == report.prompt_tokens == one.prompt_tokens
    assert report.steps == sum(d["steps"] for d in devices)
    assert progress.device_rows == [d["rows"] for d in devices]
    shown = io.StringIO()
    report.render(Console(file=shown, width=160))
    assert "device cpu#0" in shown.getvalue() and "device cpu#1" in shown.getvalue()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert tracks == {"cpu#0/engine", "cpu#1/engine"}  # one track per device
    assert sum(e["ph"] == "X" for e in events) == report.steps


def test_arrivals_under_rate_on_two_engines_write_the_one_device_output(rows_file, ckpt, tmp_path, one_device):
    out = tmp_path / "out.jsonl"
    cfg = config(rows_file, out, ckpt, "cpu,cpu")
    run_generate(replace(cfg, input=replace(cfg.input, rate=400.0)))
    assert _texts(out) == one_device[0]


def _sleep(seconds: float):
    return lambda: time.sleep(seconds)


def test_a_slowed_engine_is_given_fewer_tokens(rows_file, ckpt, tmp_path, one_device):
    out = tmp_path / "out.jsonl"
    # NOTE: 0.1 s a step, far above a step of this model however busy the machine: the gap is the hook's
    report = run_generate(config(rows_file, out, ckpt, "cpu,cpu"), step_hooks={"cpu#1": _sleep(0.1)})
    assert _texts(out) == one_device[0]
    fast, slow = report.devices
    assert slow["completion_tokens"] < fast["completion_tokens"], report.devices
    assert slow["rows"] < fast["rows"], report.devices


class _LostAfter:
    """A device that breaks down after a number of engine steps, as a GPU that falls off the bus."""

    def __init__(self, steps: int, once_committed: Path | None = None) -> None:
        self.left = steps
        self.once_committed = once_committed  # a manifest: break only after it lists a window

    def __call__(self) -> None:
        self.left -= 1
        if self.left < 0 and (self.once_committed is None or _committed_windows(self.once_committed)):
            raise RuntimeError("device lost")


def _committed_windows(manifest: Path) -> int:
    # NOTE: the other engine's speed decides when the first window commits; reading the manifest
    # keeps the failure after it on any machine load (a partly written file is never read: renamed in)
    return len(json.loads(manifest.read_text())["windows"]) if manifest.exists() else 0


def test_every_engine_failing_names_each_device_and_committed_windows_resume(rows_file, ckpt, tmp_path, one_device):
    out = tmp_path / "out.jsonl"
    cfg = config(rows_file, out, ckpt, "cpu,cpu")
    manifest_path = Path(f"{out}.parts") / "manifest.json"
    with pytest.raises(
        DevicesFailed,
        match=r"every device failed: engine@cpu#0: RuntimeError: device lost; "
        r"engine@cpu#1: RuntimeError: device lost",
    ):
        hooks = {label: _LostAfter(12, once_committed=manifest_path) for label in ("cpu#0", "cpu#1")}
        run_generate(cfg, step_hooks=hooks)
    manifest = json.loads(manifest_path.read_text())
    assert 0 < len(manifest["windows"]) < 10, "windows committed before the failure are kept"
    assert not out.exists()
    report = run_generate(replace(cfg, output=replace(cfg.output, resume=True)))
    # resumed: every row the committed windows account for (written or rejected then), and any a
    # checkpoint of an open window holds; which rows those are depends on the machine's load
    committed = sum(w["rows"] + w.get("rejects", 0) for w in manifest["windows"])
    held = sum(p["rows"] for p in manifest.get("partial", []))
    assert report.rows_resumed == committed + held > 0
    assert report.rows + report.rows_resumed + sum(report.rejects.values()) == report.accounting["rows_read"]
    assert _texts(out) == one_device[0]


def test_a_device_that_fails_for_good_leaves_the_run_to_the_others(rows_file, ckpt, tmp_path, one_device):
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.json"
    lost = _LostAfter(6)  # and every step after: its breaker opens on the second failure
    stream = io.StringIO()
    cfg = replace(config(rows_file, out, ckpt, "cpu,cpu,cpu"), trace_path=str(trace))
    report = run_generate(cfg, step_hooks={"cpu#1": lost}, progress=Progress("log", stream=stream))
    assert "hpcinfer: device cpu#1 open at" in stream.getvalue()  # the progress line says so at once
    marks = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "breaker open"]
    assert len(marks) == 1
    assert _texts(out) == one_device[0]  # greedy, seeded and unseeded answers unchanged, byte for byte
    opened = [t for t in report.device_faults if t["state"] == "open"]
    assert [t["device"] for t in opened] == ["cpu#1"] and "device lost" in opened[0]["reason"]
    assert report.moved_prompts.get("cpu#1", 0) > 0
    assert sum(d["rows"] for d in report.devices) == report.rows
    console = Console(file=io.StringIO(), width=200)
    report.render(console)
    assert "device cpu#1 at" in console.file.getvalue() and "prompts moved" in console.file.getvalue()


class _FailsThenRecovers:
    """Two failing steps (the breaker opens), then a healthy device again."""

    def __init__(self, after: int) -> None:
        self.step, self.after = 0, after

    def __call__(self) -> None:
        self.step += 1
        if self.after < self.step <= self.after + 2:
            raise RuntimeError("transient fault")


def test_a_device_that_recovers_gets_work_again_after_the_cooldown(rows_file, ckpt, tmp_path, one_device):
    out = tmp_path / "out.jsonl"
    cfg = config(rows_file, out, ckpt, "cpu,cpu")
    cfg = replace(cfg, device=replace(cfg.device, breaker_cooldown=0.2))
    slow_other = _sleep(0.02)  # the healthy device is slower, so the run lasts past the cool-down
    flaky = _FailsThenRecovers(after=2)
    report = run_generate(cfg, step_hooks={"cpu#0": slow_other, "cpu#1": flaky})
    assert _texts(out) == one_device[0]
    states = [(t["device"], t["state"]) for t in report.device_faults]
    assert states == [("cpu#1", "open"), ("cpu#1", "half-open"), ("cpu#1", "closed")], report.device_faults
    closed_at = report.device_faults[-1]["at_s"]
    assert flaky.step > 4 and report.devices[1]["rows"] > 0  # steps and answers after it recovered
    assert 0 < report.share_after_recovery["cpu#1"] <= 1  # its share of the tokens generated since
    assert closed_at > 0


def test_a_hung_device_is_given_up_after_the_step_timeout(rows_file, ckpt, tmp_path, one_device):
    release = threading.Event()
    steps = {"n": 0}

    def hangs() -> None:
        steps["n"] += 1
        if steps["n"] == 4:
            release.wait(60)  # a step that does not come back (until the test ends)

    out = tmp_path / "out.jsonl"
    cfg = config(rows_file, out, ckpt, "cpu,cpu")
    cfg = replace(cfg, device=replace(cfg.device, step_timeout=2.0))
    try:
        started = time.perf_counter()
        report = run_generate(cfg, step_hooks={"cpu#1": hangs})
        took = time.perf_counter() - started
    finally:
        release.set()
    assert _texts(out) == one_device[0]
    assert [(t["device"], t["state"]) for t in report.device_faults][:1] == [("cpu#1", "open")]
    assert "step-timeout" in report.device_faults[0]["reason"] and report.moved_prompts["cpu#1"] > 0
    assert took < 30  # nothing waited for the hung step


def test_kill_9_and_resume_across_two_devices(rows_file, ckpt, tmp_path, one_device):
    out = tmp_path / "killed.jsonl"
    args = [str(rows_file), "-o", str(out), "--model", str(ckpt), "--devices", "cpu,cpu", "--threads", "1"]
    args += ["--max-tokens", "8", "--window-rows", "5", "--kv-cache-memory", "8MiB", "--max-num-seqs", "4"]
    args += ["--progress", "off", "-q"]
    killed = subprocess.run(
        [sys.executable, str(CRASH_RUN), "manifest_renamed", "4", *args], env=ENV, capture_output=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr
    manifest = json.loads((Path(f"{out}.parts") / "manifest.json").read_text())
    assert len(manifest["windows"]) == 3  # the first manifest written is the empty one
    done = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", *args, "--resume"], env=ENV, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert _texts(out) == one_device[0]


def test_devices_of_two_kinds_or_not_cpu_or_cuda_are_refused(rows_file, ckpt, tmp_path):
    for spec, message in (("cpu,cuda:0", "one kind of device per run"), ("simulated", "runs on cpu or cuda")):
        with pytest.raises(ConfigError, match=message):
            run_generate(config(rows_file, tmp_path / "out.jsonl", ckpt, spec))
    assert not (tmp_path / "out.jsonl").exists()


def _pool(policy: str, *loads: tuple[int, float, int]) -> EnginePool:
    workers = [
        SimpleNamespace(outstanding=o, rate=r, sent=s, outbox=None, label=f"d{i}") for i, (o, r, s) in enumerate(loads)
    ]
    return EnginePool(workers, policy)  # type: ignore[arg-type]


def test_a_prompt_goes_where_it_would_be_done_soonest():
    # (outstanding tokens, tokens per second, prompts sent)
    assert _pool("tokens", (500, 100.0, 3), (100, 100.0, 3)).choose(50) == 1  # fewer outstanding
    assert _pool("tokens", (500, 1000.0, 3), (100, 100.0, 3)).choose(50) == 0  # 10x faster: done sooner
    assert _pool("tokens", (0, 0.0, 1), (0, 0.0, 0)).choose(50) == 1  # a device not yet tried comes first
    assert _pool("tokens", (300, 0.0, 2), (300, 200.0, 2)).choose(50) == 0  # unmeasured: the mean rate, ties low
    rr = _pool("round_robin", (900, 1.0, 0), (0, 1.0, 0), (0, 1.0, 0))
    assert [rr.choose(10) for _ in range(4)] == [0, 1, 2, 0]


class _Worker(SimpleNamespace):
    def submit(self, prompt) -> None:
        self.got.append(prompt.tokens)
        self.sent += 1
        self.outstanding += prompt.charge


def test_a_prompt_goes_where_its_prefix_was_sent_unless_the_balance_says_otherwise():
    workers = [_Worker(outstanding=0, rate=100.0, sent=1, got=[], outbox=None, label="d") for _ in range(2)]
    pool = EnginePool(workers, "tokens", prefix_block=4)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=2)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    pool.add([*shared, 1], params)  # 9 + 2 tokens to device 0 (a tie)
    pool.add([40, 41, 42, 43, 44], params)  # fewer outstanding: device 1
    pool.add([*shared, 2, 3], params)  # device 0 holds its 8-token prefix: 11 + 12 - 8 < 7 + 12
    assert [len(w.got) for w in workers] == [2, 1]
    pool.add([*shared, 4], params)  # the prefix's 8 tokens no longer outweigh 23 against 7 outstanding
    assert [len(w.got) for w in workers] == [2, 2]
    without = EnginePool([_Worker(outstanding=0, rate=100.0, sent=1, got=[], outbox=None, label="d") for _ in range(2)])
    for tokens in ([*shared, 1], [40, 41, 42, 43, 44], [*shared, 2, 3]):
        without.add(tokens, params)
    assert [len(w.got) for w in without.workers] == [1, 2]  # without prefix caching: 11 + 12 > 7 + 12


def test_one_device_runs_its_engine_on_the_job_thread(rows_file, ckpt, tmp_path):
    ranges = RecordingRanges()
    run_generate(config(rows_file, tmp_path / "out.jsonl", ckpt, "cpu"), ranges=ranges)
    assert ranges.events and {thread for thread, _, _ in ranges.events} == {threading.current_thread().name}


def test_profile_ranges_wrap_every_step_of_every_engine_on_its_own_thread(rows_file, ckpt, tmp_path):
    ranges = RecordingRanges()
    report = run_generate(config(rows_file, tmp_path / "out.jsonl", ckpt, "cpu,cpu"), ranges=ranges)
    threads = {thread for thread, _, _ in ranges.events}
    assert threads == {"engine@cpu#0", "engine@cpu#1"}
    for thread in threads:
        kinds = [kind for t, kind, _ in ranges.events if t == thread]
        assert kinds == ["push", "pop"] * (len(kinds) // 2)  # balanced, one at a time on each thread
        label = thread.removeprefix("engine@")
        pushes = [name for t, kind, name in ranges.events if t == thread and kind == "push"]
        assert all(name.startswith(f"hpcinfer/engine_step device={label} step=") for name in pushes)
    assert sum(kind == "push" for _, kind, _ in ranges.events) == report.steps


def test_ctrl_c_on_two_devices_keeps_committed_windows_and_says_how_to_resume(tmp_path, ckpt):
    rows = [{"id": i, "prompt": t} for i, t in enumerate(make_texts(80, seed=2))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = [str(src), "--model", str(ckpt), "--devices", "cpu,cpu", "--threads", "1", "--window-rows", "2"]
    args += ["--max-num-seqs", "2", "--progress", "off", "-o", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcinfer", "run", *args], env=ENV, stderr=subprocess.PIPE, text=True
    )
    manifest = Path(str(out) + ".parts") / "manifest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(manifest.read_text())["windows"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "rows are committed" in stderr and "--resume" in stderr
    assert json.loads(manifest.read_text())["windows"] and not out.exists()
