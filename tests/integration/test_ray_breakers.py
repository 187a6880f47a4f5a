"""Circuit breakers per replica on `--engine ray`: a replica that fails, hangs or recovers changes
where windows run, never what is written.

One local Ray instance (3 CPUs: three replicas of one thread each) serves the module. Faults are
injected where real ones come from (the device's forward, an engine step: tests/integration/ray_helpers.py),
so the replicas' own classification sees them. Every run uses one torch thread, locally and in
the replicas, so "equal" is bit for bit.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from hpcinfer.api import run
from hpcinfer.config import ClusterConfig, DeviceConfig, GenerateConfig, InputConfig, OutputConfig, RunConfig
from hpcinfer.errors import ConfigError, DevicesFailed
from hpcinfer.obs.progress import Progress
from hpcinfer.pipeline.cluster import EmbedCluster
from hpcinfer.ray_engine.driver import run_on_ray
from hpcinfer.tasks.generate.cluster import GenerateCluster
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, read_output, run_job, small_config, write_jsonl
from .ray_helpers import FlakyActor, HangsActor, LostActor, PoisonedActor, local_ray

PLAN = {"sort_window": 30}  # 8 windows of 240 rows


@pytest.fixture(scope="module")
def ray_address():  # noqa: ANN201
    yield from local_ray(cpus=3)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):  # noqa: ANN201
    """240 rows (8 windows of 30), bad rows among them: rejects, which must never open a breaker."""
    lines = [json.dumps({"id": f"r{i}", "text": t}) for i, t in enumerate(make_texts(240, seed=8))]
    lines[3] = json.dumps({"id": "r3", "text": ""})  # empty_text
    lines[70] = '{"id": "broken", "text": '  # malformed_json
    lines[95] = json.dumps({"id": "r4", "text": "again"})  # duplicate_id, of another window
    lines[160] = json.dumps({"id": "r160", "text": 12})  # not text
    src = tmp_path_factory.mktemp("breakers") / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return src


@pytest.fixture(scope="module")
def healthy(rows, tiny_model, tmp_path_factory):  # noqa: ANN201
    out = tmp_path_factory.mktemp("healthy") / "out.parquet"
    run_job(_embed(rows, out, tiny_model))
    return out


def _embed(src: Path, out: Path, model: Path, replicas: int | None = None, **device: object):  # noqa: ANN202
    cfg = small_config(src, out, model, plan=PLAN, device={"threads": 1, **device})
    return cfg if replicas is None else replace(cfg, cluster=ClusterConfig("ray", replicas=replicas))


def _same(out: Path, healthy: Path) -> None:
    assert read_output(out).equals(read_output(healthy))  # bit for bit
    assert Path(f"{out}.rejects.jsonl").read_text() == Path(f"{healthy}.rejects.jsonl").read_text()


def _states(report) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(t["device"], t["state"]) for t in report.device_faults]


def _shown(report) -> str:  # noqa: ANN001
    console = Console(file=io.StringIO(), width=200)
    report.render(console)
    return console.file.getvalue()


def test_a_replica_lost_for_good_leaves_the_run_to_the_others(tmp_path, tiny_model, rows, healthy, ray_address):
    out, stream = tmp_path / "out.parquet", io.StringIO()
    cfg = _embed(rows, out, tiny_model, 3, breaker_failures=1)  # NOTE: one fault opens: bad rows must not
    report = run_on_ray(cfg, EmbedCluster(), progress=Progress("log", stream), replica_cls=LostActor)
    _same(out, healthy)
    assert sum(report.rejects.values()) == 4  # the bad rows are rejects, on the replicas that stayed closed
    [(lost, state)] = _states(report)
    assert state == "open" and "RuntimeError: device lost" in report.device_faults[0]["reason"]
    assert report.cluster["windows_moved"] == 1 and report.cluster["moved_from"] == {lost: {"windows": 1, "rows": 30}}
    assert f"hpcinfer: {lost} open at" in stream.getvalue() and f"moved from {lost}" in stream.getvalue()
    assert not any(d["device"].startswith(f"{lost} ") for d in report.devices)  # it finished nothing
    assert report.accounting["balanced"] and report.rows == 236
    shown = _shown(report)
    assert f"device {lost} at" in shown and f"moved 1 window (30 rows) from {lost}" in shown


def test_a_replica_that_recovers_gets_work_again_after_the_cooldown(tmp_path, tiny_model, rows, healthy, ray_address):
    out = tmp_path / "out.parquet"
    cfg = _embed(rows, out, tiny_model, 2, breaker_cooldown=0.5)
    report = run_on_ray(cfg, EmbedCluster(), progress=Progress("off"), replica_cls=FlakyActor)
    _same(out, healthy)
    flaky = report.device_faults[0]["device"]
    assert _states(report) == [(flaky, "open"), (flaky, "half-open"), (flaky, "closed")]
    assert report.cluster["moved_from"] == {flaky: {"windows": 2, "rows": 60}}
    assert sum(d["units"] for d in report.devices if d["device"].startswith(f"{flaky} ")) >= 1  # after it recovered


def test_every_replica_failing_names_each_and_resume_completes(tmp_path, tiny_model, rows, healthy, ray_address):
    out = tmp_path / "out.parquet"
    cfg = _embed(rows, out, tiny_model, 2, breaker_failures=1)
    with pytest.raises(DevicesFailed) as failed:
        run_on_ray(cfg, EmbedCluster(), progress=Progress("off"), replica_cls=PoisonedActor)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("every replica failed: replica#0 (")
    assert message.count("RuntimeError: device lost") == 2 and "; replica#1 (" in message
    manifest = json.loads((Path(f"{out}.parts") / "manifest.json").read_text())
    assert [w["window"] for w in manifest["windows"]] == [0, 1]  # committed before the failures: kept
    local = replace(cfg, cluster=ClusterConfig(), output=replace(cfg.output, resume=True))
    report, _ = run_job(local)  # NOTE: either engine resumes the other's output
    assert report.rows_resumed == sum(w["input_rows"] for w in manifest["windows"]) > 0
    _same(out, healthy)


def test_a_hung_replica_is_given_up_after_the_step_timeout(tmp_path, tiny_model, rows, healthy, ray_address):
    out = tmp_path / "out.parquet"
    # NOTE: the healthy replica must make progress within the timeout on a busy 2-core machine too
    # (2 s failed there: both replicas were given up); the hung one hangs until killed, whatever it is
    cfg = _embed(rows, out, tiny_model, 2, step_timeout=8.0)
    started = time.perf_counter()
    report = run_on_ray(cfg, EmbedCluster(), progress=Progress("off"), replica_cls=HangsActor)
    assert time.perf_counter() - started < 60  # nothing waited for the hung forward
    _same(out, healthy)
    [(hung, state)] = _states(report)
    assert state == "open" and "--step-timeout 8 s" in report.device_faults[0]["reason"]
    assert report.cluster["moved_from"] == {hung: {"windows": 1, "rows": 30}}


def test_bad_breaker_settings_are_refused_before_ray_starts(tmp_path, tiny_model, rows):
    with pytest.raises(ConfigError, match="--breaker-failures must be at least 1"):
        run_job(_embed(rows, tmp_path / "o.parquet", tiny_model, 2, breaker_failures=0))
    with pytest.raises(ConfigError, match="--step-timeout must be above 0 seconds"):
        run_job(_embed(rows, tmp_path / "o.parquet", tiny_model, 2, step_timeout=0.0))
    assert not Path(f"{tmp_path}/o.parquet.parts").exists()


def test_generation_with_a_replica_lost_for_good_answers_as_a_healthy_run(tmp_path, ray_address):
    ckpt = build_tiny_decoder(tmp_path / "gen", "Qwen2ForCausalLM", seed=4, max_positions=128)
    prompts = []
    for i, text in enumerate(make_texts(16, seed=5)):
        row = {"id": f"q{i}", "prompt": " ".join(text.split()[:12]), "max_tokens": 2 + i % 4}
        if i % 3 == 1:
            row.update(temperature=0.9, top_p=0.9, seed=100 + i)  # seeded
        elif i % 3 == 2:
            row.update(temperature=1.0)  # unseeded: the row number decides
        prompts.append(row)
    src = write_jsonl(tmp_path / "prompts.jsonl", prompts)

    def config(out: Path, replicas: int | None = None) -> RunConfig:
        cfg = RunConfig(
            input=InputConfig((str(src),)),
            model=str(ckpt),
            output=OutputConfig(str(out)),
            device=DeviceConfig(device="cpu", threads=1, breaker_failures=1),
            generate=GenerateConfig(max_tokens=4, window_rows=4, kv_cache_memory="8MiB", max_num_seqs=4),
        )
        return cfg if replicas is None else replace(cfg, cluster=ClusterConfig("ray", replicas=replicas))

    run(config(tmp_path / "local.jsonl"), progress=Progress("off"))
    report = run_on_ray(
        config(tmp_path / "ray.jsonl", 2), GenerateCluster(), progress=Progress("off"), replica_cls=LostActor
    )
    assert (tmp_path / "ray.jsonl").read_text() == (tmp_path / "local.jsonl").read_text()  # token for token
    [(lost, state)] = _states(report)
    assert state == "open" and "RuntimeError: device lost" in report.device_faults[0]["reason"]
    assert report.cluster["moved_from"] == {lost: {"windows": 1, "rows": 4}}
    assert report.rows == 16 and report.accounting["balanced"]
    assert f"device {lost} at" in _shown(report)
