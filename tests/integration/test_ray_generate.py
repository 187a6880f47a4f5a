"""`--engine ray` for a causal LM gives what the local generation engine gives: answers, rejects, resume.

One local Ray instance (2 CPUs) serves the module; a tiny random decoder, windows of 4 rows and a
few tokens per answer keep each run to seconds. Rows mix greedy, seeded and unseeded sampling, so
"equal" covers both kinds of decoding. Without Ray, the unit reader is checked against the local
request reader directly.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from hpcinfer.api import run
from hpcinfer.config import (
    ClusterConfig,
    DeviceConfig,
    GenerateConfig,
    InputConfig,
    OutputConfig,
    PipelineConfig,
    RunConfig,
)
from hpcinfer.errors import ConfigError, OutputError
from hpcinfer.models.decoder_checkpoint import load_tokenizer
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.obs.progress import Progress
from hpcinfer.obs.render import render
from hpcinfer.ray_engine.units import plan_units
from hpcinfer.tasks.generate.cluster import GenerateCluster, request_source
from hpcinfer.tasks.generate.replica import RangeRequestReader
from hpcinfer.tasks.generate.setup import request_reader
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import REPO, make_texts, write_parquet
from .ray_helpers import local_ray

CRASH_RUN = Path(__file__).with_name("crash_run.py")
WINDOW = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):  # noqa: ANN201
    return build_tiny_decoder(tmp_path_factory.mktemp("gen"), "Qwen2ForCausalLM", seed=4, max_positions=128)


@pytest.fixture(scope="module")
def ray_address():  # noqa: ANN201
    yield from local_ray()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, ckpt):  # noqa: ANN001, ANN201
    """(inputs, the local engine's JSONL answers and report) of `_inputs`: what the Ray runs of them equal."""
    folder = tmp_path_factory.mktemp("local")
    inputs = _inputs(folder)
    report = run(_config(inputs, folder / "local.jsonl", ckpt), progress=Progress("off"))
    return inputs, folder / "local.jsonl", report


def _inputs(tmp_path: Path) -> list[Path]:
    """A JSONL file (a BOM, CRLF, blank lines, bad rows) and a Parquet file; an id repeats across windows."""
    rows = []
    for i, text in enumerate(make_texts(26, seed=5)):
        row = {"id": f"r{i}", "prompt": " ".join(text.split()[:12]), "max_tokens": 2 + i % 4}
        if i % 3 == 1:
            row.update(temperature=0.9, top_p=0.9, seed=100 + i)  # seeded
        elif i % 3 == 2:
            row.update(temperature=1.0)  # unseeded: the row number decides
        rows.append(row)
    rows[2]["prompt"] = " ".join(["fox"] * 200)  # too_long: the context holds 127 tokens
    rows[5]["top_p"] = 1.5  # invalid_sampling
    rows[9]["id"] = "r3"  # repeats an id of the first window: only the driver can see it
    rows[10]["id"] = "r8"  # repeats an id of its own window: the replica's reader sees it
    rows[20]["id"] = "r14"  # repeats an id of the other file's window
    lines = [json.dumps(r) for r in rows[:14]]
    lines[6] = '{"id": "broken", "prompt": '  # malformed_json
    body = "\ufeff" + "\r\n".join(lines[:5]) + "\n\n\n" + "\n".join(lines[5:]) + "\n"
    a = tmp_path / "a.jsonl"
    a.write_bytes(body.encode("utf-8"))
    b = write_parquet(tmp_path / "b.parquet", rows[14:], row_group_size=3)
    return [a, b]


def _config(inputs: list[Path], out: Path, model: Path, replicas: int | None = None, **over: object) -> RunConfig:
    gen = {"max_tokens": 4, "window_rows": WINDOW, "kv_cache_memory": "8MiB", "max_num_seqs": 4}
    cfg = RunConfig(
        input=InputConfig(tuple(str(p) for p in inputs)),
        model=str(model),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(device="cpu", threads=1),
        generate=GenerateConfig(**{**gen, **over}),
    )
    return cfg if replicas is None else replace(cfg, cluster=ClusterConfig("ray", replicas=replicas))


def _same_output(a: Path, b: Path) -> None:
    assert b.read_text() == a.read_text()
    assert Path(f"{b}.rejects.jsonl").read_text() == Path(f"{a}.rejects.jsonl").read_text()


def test_unit_readers_read_what_the_whole_input_reader_reads(tmp_path, ckpt):
    inputs = _inputs(tmp_path)
    cfg = _config(inputs, tmp_path / "o.jsonl", ckpt)
    info = inspect_decoder(ckpt)
    whole = request_reader(cfg, info, load_tokenizer(info))
    units, totals = plan_units([request_source(f, whole.has_ids[f]) for f in whole.files], WINDOW)
    assert list(totals.values()) == [14, 12]
    assert [(u.first_row, u.input_rows, len(u.segments)) for u in units] == [
        (0, 4, 1),
        (4, 4, 1),
        (8, 4, 1),
        (12, 4, 2),  # straddles the two files
        (16, 4, 1),
        (20, 4, 1),
        (24, 2, 1),
    ]

    def key(item):  # noqa: ANN001, ANN202
        if hasattr(item, "reason"):
            return ("reject", item.row, item.to_json())
        return ("request", item.row, item.id, item.tokens, item.params, item.source)

    everything = [key(item) for item in whole.produce()]
    repeated = [k for k in everything if k[0] == "reject" and k[2]["reason"] == "duplicate_id"]
    assert [(r[1], r[2]["id"]) for r in repeated] == [(9, "r3"), (10, "r8"), (20, "r14")]
    ranged = []
    for unit in units:
        ranged += [key(item) for item in RangeRequestReader(whole, unit).produce()]
    # NOTE: the unit readers let through ids of earlier windows (rows 9 and 20): the driver's to find.
    assert [k for k in ranged if k[0] == "request" and k[1] in (9, 20)] == [
        ("request", 9, "r3", *ranged[9][3:]),
        ("request", 20, "r14", *ranged[20][3:]),
    ]
    assert [k for k in ranged if k[1] not in (9, 20)] == [k for k in everything if k[1] not in (9, 20)]
    assert len(ranged) == len(everything) == 26


def test_ray_answers_and_rejects_equal_the_local_engine(tmp_path, ckpt, ray_address, local_run):
    inputs, local_out, local = local_run
    report = run(_config(inputs, tmp_path / "ray.jsonl", ckpt, replicas=2), progress=Progress("off"))
    _same_output(local_out, tmp_path / "ray.jsonl")
    rejects = [json.loads(x) for x in Path(f"{tmp_path}/ray.jsonl.rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["row"], r.get("line")) for r in rejects] == [
        ("too_long", 2, 3),
        ("invalid_sampling", 5, 8),  # line 8: the blank lines after line 5 count
        ("malformed_json", 6, 9),
        ("duplicate_id", 9, 12),
        ("duplicate_id", 10, 13),
        ("duplicate_id", 20, None),
    ]
    assert report.rows == local.rows == 20 and report.rejects == local.rejects
    assert report.accounting["rows_read"] == 26 and report.accounting["balanced"]
    assert report.windows == local.windows == 7
    # NOTE: rows 9 and 20 were answered by their replicas before the driver turned them into
    # rejects: the work done counts them, the output does not.
    assert sum(d["rows"] for d in report.devices) == report.rows + 2
    assert report.completion_tokens > local.completion_tokens
    assert report.cluster["replicas"] == 2 and report.cluster["slowest_actor"]
    assert sum(d["units"] for d in report.devices) == 7 and all(d["busy_s"] > 0 for d in report.devices)
    console = Console(file=io.StringIO(), width=200)
    render(report, console)
    shown = console.file.getvalue()
    assert "per actor" in shown and f"slowest actor {report.cluster['slowest_actor']}" in shown
    assert report.to_dict()["cluster"]["replicas"] == 2 and report.to_dict()["devices"] == report.devices


def test_a_gemma3_on_ray_answers_as_the_local_engine(tmp_path, ray_address):
    """A family beyond Llama's (Gemma 3: sliding-window layers, crossed by the prompts) on 2 replicas."""
    windows = {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    model = build_tiny_decoder(tmp_path / "gemma3", "Gemma3ForCausalLM", seed=4, max_positions=128, **windows)
    inputs = _inputs(tmp_path)
    local = run(_config(inputs, tmp_path / "local.jsonl", model), progress=Progress("off"))
    report = run(_config(inputs, tmp_path / "ray.jsonl", model, replicas=2), progress=Progress("off"))
    _same_output(tmp_path / "local.jsonl", tmp_path / "ray.jsonl")
    assert report.rows == local.rows == 20 and report.backend == local.backend == "native"


def test_openai_batch_answers_equal_the_local_engine(tmp_path, ckpt, ray_address):
    rows = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": t, "max_tokens": 3}}
        for i, t in enumerate(make_texts(5, seed=1))
    ]
    rows[3] = {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "temperature": 0.7},
    }
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    run(_config([src], tmp_path / "local.jsonl", ckpt), progress=Progress("off"))
    run(_config([src], tmp_path / "ray.jsonl", ckpt, replicas=1), progress=Progress("off"))
    assert (tmp_path / "ray.jsonl").read_text() == (tmp_path / "local.jsonl").read_text()
    got = [json.loads(x) for x in (tmp_path / "ray.jsonl").read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["c0", "c1", "c2", "chat", "c4"]
    assert got[3]["response"]["body"]["object"] == "chat.completion"


def test_an_actor_killed_mid_run_is_restarted_and_the_parquet_answers_are_identical(tmp_path, ckpt, ray_address):
    from hpcinfer.ray_engine.driver import run_on_ray

    from .ray_helpers import DiesOnceActor

    inputs = _inputs(tmp_path)
    run(_config(inputs, tmp_path / "local.parquet", ckpt), progress=Progress("off"))
    cfg = _config(inputs, tmp_path / "ray.parquet", ckpt, replicas=1)
    report = run_on_ray(cfg, GenerateCluster(), progress=Progress("off"), replica_cls=DiesOnceActor)
    assert (tmp_path / "ray.parquet.died").exists()  # the actor did die, on its second window
    assert report.cluster["actor_restarts_seen"] >= 1
    local, ray = pq.read_table(tmp_path / "local.parquet"), pq.read_table(tmp_path / "ray.parquet")
    assert ray.num_rows == 20 and ray.equals(local)
    assert (
        Path(f"{tmp_path}/ray.parquet.rejects.jsonl").read_text()
        == Path(f"{tmp_path}/local.parquet.rejects.jsonl").read_text()
    )
    assert report.rows == 20 and report.accounting["balanced"]


def _cli_args(inputs: list[Path], out: Path, ckpt: Path) -> list[str]:
    """`hpcinfer run` arguments equal to `_config`'s."""
    args = [*map(str, inputs), "-o", str(out), "--model", str(ckpt), "--window-rows", str(WINDOW)]
    args += ["--max-tokens", "4", "--kv-cache-memory", "8MiB", "--max-num-seqs", "4", "--device", "cpu"]
    return [*args, "--threads", "1", "--progress", "off", "-q"]


def _env() -> dict[str, str]:
    """The environment of a CLI run, read when it starts (Ray adds what a client of its instance needs)."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


def test_driver_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, ckpt, ray_address, local_run):
    inputs, local_out, _ = local_run
    out = tmp_path / "ray.jsonl"
    args = _cli_args(inputs, out, ckpt)
    ray_args = ["--engine", "ray", "--replicas", "1", "--ray-address", ray_address]
    # NOTE: the fourth manifest write is the third window's commit: SIGKILL there, no cleanup.
    killed = subprocess.run(
        [sys.executable, str(CRASH_RUN), "manifest_renamed", "4", *args, *ray_args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    manifest = json.loads((tmp_path / "ray.jsonl.parts" / "manifest.json").read_text())
    assert [w["window"] for w in manifest["windows"]] == [0, 1, 2]
    assert not out.exists()

    resume = {"output": replace(OutputConfig(str(out)), resume=True)}
    with pytest.raises(OutputError, match="option window_rows differs"):  # resuming with another option
        run(replace(_config(inputs, out, ckpt, replicas=1, window_rows=5), **resume), progress=Progress("off"))
    report = run(replace(_config(inputs, out, ckpt, replicas=1), **resume), progress=Progress("off"))
    # NOTE: windows 0-2 (12 input rows, 5 of them rejected then) resumed; 20 rows in the output
    assert report.rows_resumed == report.accounting["rows_resumed"] == 12 and report.rows == 20 - 7
    assert report.accounting["balanced"]
    _same_output(local_out, out)


def test_a_local_run_killed_9_resumes_on_ray_identically(tmp_path, ckpt, ray_address, local_run):
    inputs, local_out, _ = local_run
    out = tmp_path / "moved.jsonl"
    killed = subprocess.run(
        [sys.executable, str(CRASH_RUN), "manifest_renamed", "3", *_cli_args(inputs, out, ckpt)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len(json.loads((tmp_path / "moved.jsonl.parts" / "manifest.json").read_text())["windows"]) == 2
    resume = {"output": replace(OutputConfig(str(out)), resume=True)}
    report = run(replace(_config(inputs, out, ckpt, replicas=1), **resume), progress=Progress("off"))
    assert report.accounting["rows_resumed"] == 8 and report.accounting["balanced"]
    _same_output(local_out, out)


def test_a_tensor_parallel_replica_equals_the_local_engine(tmp_path, ckpt, ray_address, local_run):
    """--tp 2 on Ray: the replica's actor is rank 0 of a group whose rank 1 it starts itself."""
    inputs, local_out, local = local_run
    cfg = _config(inputs, tmp_path / "ray.jsonl", ckpt, replicas=1)
    report = run(replace(cfg, device=replace(cfg.device, tensor_parallel=2)), progress=Progress("off"))
    _same_output(local_out, tmp_path / "ray.jsonl")
    assert report.rows == local.rows and report.rejects == local.rejects
    gpus = replace(cfg, cluster=replace(cfg.cluster, gpus_per_replica=1), device=replace(cfg.device, tensor_parallel=2))
    with pytest.raises(ConfigError, match=re.escape("--tp 2 with --engine ray on GPUs needs --gpus-per-replica 2")):
        run(gpus, progress=Progress("off"))


def test_ray_generation_refuses_what_it_cannot_do(tmp_path, ckpt):
    inputs = _inputs(tmp_path)
    cfg = _config(inputs, tmp_path / "o.jsonl", ckpt, replicas=1)
    with pytest.raises(ConfigError, match="--rate is not available with --engine ray"):
        run(replace(cfg, input=replace(cfg.input, rate=10.0)), progress=Progress("off"))
    with pytest.raises(ConfigError, match="--cuda-graphs is not available for generation"):
        run(replace(cfg, device=replace(cfg.device, cuda_graphs=True)), progress=Progress("off"))
    assert not (tmp_path / "o.jsonl.parts").exists()


def test_serve_runs_its_batches_on_ray(ckpt, ray_address, tmp_path):
    """`hpcinfer serve` with `engine = "ray"` in its recipe: each batch is a Ray job, answered as locally."""
    from tests.integration.test_serve_shared import Local, chat_line, create, lines_of, upload, wait_for

    recipe = tmp_path / "serve.toml"
    recipe.write_text(f'engine = "ray"\nray-address = "{ray_address}"\nwindow-rows = {WINDOW}\n', encoding="utf-8")
    lines = [chat_line(i) for i in range(10)]
    answers = {}
    for name, given in (("ray", recipe), ("local", None)):
        server = Local(ckpt, tmp_path / name, recipe=given)
        try:
            client = server.client()
            done = wait_for(client, create(client, upload(client, lines).id).id, timeout=300)
            assert done.status == "completed" and done.request_counts.completed == 10, done
            got = lines_of(client, done.output_file_id)
            answers[name] = {a["custom_id"]: a["response"]["body"]["choices"][0]["message"]["content"] for a in got}
        finally:
            server.close()
    assert answers["ray"] == answers["local"] and len(answers["ray"]) == 10


def test_lora_rows_on_ray_answer_as_locally(ckpt, ray_address, tmp_path):
    """--lora with --engine ray: each replica attaches the adapter; rows pick it or the base as locally."""
    import peft
    import torch
    import transformers

    model = transformers.Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    torch.manual_seed(5)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "adapter")
    rows = [{"id": f"r{i}", "prompt": t, "max_tokens": 4, **({"lora": "tuned"} if i % 2 else {})}
            for i, t in enumerate(make_texts(12, seed=9))]  # fmt: skip
    answers = _local_and_ray(rows, ckpt, ray_address, tmp_path, loras=(f"tuned={tmp_path / 'adapter'}",))
    assert answers["ray"] == answers["local"] and len(answers["ray"]) == 12


def test_image_chats_on_ray_answer_as_locally(ray_address, tmp_path):
    """A vision-language model with --engine ray: each replica's engine has the vision tower."""
    import base64

    from PIL import Image

    from ..fixtures.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(tmp_path / "vlm", seed=4)
    rows = []
    for i in range(10):
        buffer = io.BytesIO()
        Image.new("RGB", (30 + 7 * i, 40), (20 * i, 120, 60)).save(buffer, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": f"what is {i}"}]
        rows.append({"id": f"r{i}", "messages": [{"role": "user", "content": content}], "max_tokens": 5})
    answers = _local_and_ray(rows, vlm, ray_address, tmp_path)
    assert answers["ray"] == answers["local"] and len(answers["ray"]) == 10


def _local_and_ray(rows: list[dict], model: Path, ray_address: str, tmp_path: Path, **generate) -> dict[str, list]:  # noqa: ANN003
    """The answer lines of `rows` run on the local engine and on Ray (2 replicas), same options."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    answers = {}
    for engine in ("local", "ray"):
        out = tmp_path / f"{engine}.jsonl"
        cfg = RunConfig(
            input=InputConfig((str(src),)),
            model=str(model),
            output=OutputConfig(str(out)),
            pipeline=PipelineConfig(progress="off"),
            generate=GenerateConfig(window_rows=WINDOW, **generate),
            cluster=ClusterConfig(engine=engine, ray_address=ray_address if engine == "ray" else None),
        )
        run(cfg, progress=Progress("off"))
        answers[engine] = [json.loads(x) for x in out.read_text().splitlines()]
    return answers
