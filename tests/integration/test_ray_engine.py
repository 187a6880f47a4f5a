"""`--engine ray` gives what the local engine gives: same rows, order, values, rejects, resume.

One local Ray instance (2 CPUs, a small object store) serves the whole module; the tiny random
checkpoint keeps each run to seconds. Without Ray, the pieces that do not need it (work units,
the range reader) are checked against the local reader directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.config import ClusterConfig, DeviceConfig
from hpcinfer.errors import ConfigError, OutputError
from hpcinfer.obs.progress import Progress
from hpcinfer.pipeline.read import Reader
from hpcinfer.pipeline.replica import RangeReader
from hpcinfer.ray_engine.units import plan_units

from ..conftest import REPO, make_texts, read_output, run_job, small_config, write_jsonl, write_parquet
from .ray_helpers import local_ray

CRASH_RUN = Path(__file__).with_name("crash_run.py")


def _inputs(tmp_path: Path) -> list[Path]:
    """A JSONL file (blank lines, a BOM, CRLF, bad rows) and a Parquet file; ids repeat across windows."""
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(420, seed=3))]
    rows[7]["text"] = "   "  # empty_text
    rows[130]["id"] = "r2"  # repeats an id of the first window: only the driver can see it
    rows[333]["id"] = "r131"  # repeats an id of another file's window
    lines = [json.dumps(r) for r in rows[:200]]
    lines[40] = '{"id": "broken", "text": '  # malformed_json
    body = "\ufeff" + "\r\n".join(lines[:100]) + "\n\n\n" + "\n".join(lines[100:]) + "\n"
    a = tmp_path / "a.jsonl"
    a.write_bytes(body.encode("utf-8"))
    b = write_parquet(tmp_path / "b.parquet", rows[200:], row_group_size=37)
    return [a, b]


def test_units_and_range_reader_match_the_whole_input_reader(tmp_path, tiny_model):
    inputs = _inputs(tmp_path)
    cfg = small_config(inputs, tmp_path / "o.parquet", tiny_model)
    whole = list(Reader(cfg.input, cfg.plan.sort_window).produce())
    units, totals = plan_units(Reader(cfg.input, cfg.plan.sort_window).sources, cfg.plan.sort_window)
    assert list(totals.values()) == [200, 220]
    assert [(u.first_row, u.input_rows) for u in units] == [(0, 120), (120, 120), (240, 120), (360, 60)]
    assert [len(u.segments) for u in units] == [1, 2, 1, 1]  # the second window straddles the two files
    repeated = {r.row for b in whole for r in b.rejects if r.reason == "duplicate_id"}
    assert repeated == {130, 333}  # ids of earlier windows: the driver's to find, not a range reader's

    def rows(blocks):  # noqa: ANN001, ANN202
        kept = [
            (r, i, x, t)
            for b in blocks
            for r, i, x, t in zip(b.rows, b.ids, b.lines, b.texts, strict=True)
            if r not in repeated
        ]
        rejects = [
            (r.row, r.line, r.id, r.reason, r.row_in_file) for b in blocks for r in b.rejects if r.row not in repeated
        ]
        return kept, rejects

    for unit in units:
        ranged = list(RangeReader(cfg.input, cfg.plan.sort_window, unit).produce())
        mine = [b for b in whole if unit.first_row <= b.first_row < unit.first_row + unit.input_rows]
        assert rows(ranged) == rows(mine)
        assert sum(b.input_rows for b in ranged) == unit.input_rows


@pytest.fixture(scope="module")
def ray_address():  # noqa: ANN201
    yield from local_ray()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model):  # noqa: ANN001, ANN201
    """(inputs, the local engine's output and report) of `_inputs`: the reference the Ray runs of them equal."""
    folder = tmp_path_factory.mktemp("local")
    inputs = _inputs(folder)
    report, _ = run_job(small_config(inputs, folder / "local.parquet", tiny_model))
    return inputs, folder / "local.parquet", report


def _ray(cfg, replicas: int = 2):  # noqa: ANN001, ANN202
    return replace(cfg, cluster=ClusterConfig("ray", replicas=replicas))


def _same_output(a: Path, b: Path) -> None:
    ta, tb = read_output(a), read_output(b)
    assert ta.column("id").to_pylist() == tb.column("id").to_pylist()
    ea, eb = np.array(ta.column("embedding").to_pylist()), np.array(tb.column("embedding").to_pylist())
    assert ea.shape == eb.shape
    np.testing.assert_allclose(ea, eb, rtol=0, atol=1e-6)
    ra, rb = Path(f"{a}.rejects.jsonl"), Path(f"{b}.rejects.jsonl")
    assert ra.read_text() == rb.read_text()


def test_ray_output_and_rejects_equal_the_local_engine(tmp_path, tiny_model, ray_address, local_run):
    inputs, local_out, local = local_run
    # --cpu-affinity auto goes with the replicas (on CPUs without GPUs it pins nothing)
    ray = small_config(inputs, tmp_path / "ray.parquet", tiny_model, device={"cpu_affinity": "auto"})
    report, _ = run_job(_ray(ray))
    _same_output(local_out, tmp_path / "ray.parquet")
    rejects = [json.loads(x) for x in Path(f"{tmp_path}/ray.parquet.rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["row"], r.get("line")) for r in rejects] == [
        ("empty_text", 7, 8),
        ("malformed_json", 40, 41),
        ("duplicate_id", 130, 133),  # line 133: the blank lines after line 100 count
        ("duplicate_id", 333, None),
    ]
    assert report.rows == local.rows == 416
    assert report.rejects == local.rejects
    assert report.accounting["rows_read"] == 420 and report.accounting["balanced"]
    # NOTE: the two rows whose ids repeat an earlier window's were embedded by their replicas before
    # the driver turned them into rejects: the work done counts them, the output does not.
    assert report.windows == 4 and report.batches >= local.batches
    assert report.real_tokens > local.real_tokens and report.padded_tokens > local.padded_tokens
    assert report.cluster["replicas"] == 2 and report.cluster["slowest_actor"]
    compute = next(s for s in report.stages if s["stage"] == "compute")
    assert compute["items"] == report.batches and compute["busy_s"] > 0
    assert sum(d["rows"] for d in report.devices) == report.rows + 2  # rows embedded, the two repeats included
    # the driver's live figures (its metrics endpoint's, the HTML report's timeline) end at the cluster's totals
    final = {k: v[-1] for k, v in report.timeline["series"].items()}
    assert final["rows.done"] + final["rows.resumed"] == report.rows
    assert final["rows.rejected"] == sum(report.rejects.values()) == 4
    assert final["tokens.input"] == report.real_tokens and final["windows"] == report.windows
    assert sum(v for k, v in final.items() if k.startswith("device_rows.replica#")) == report.rows


def test_an_actor_killed_mid_run_is_restarted_and_the_output_is_identical(tmp_path, tiny_model, ray_address, local_run):
    from hpcinfer.pipeline.cluster import EmbedCluster
    from hpcinfer.ray_engine.driver import run_on_ray

    from .ray_helpers import DiesOnceActor

    inputs, local_out, _ = local_run
    cfg = _ray(small_config(inputs, tmp_path / "ray.parquet", tiny_model), replicas=1)
    report = run_on_ray(cfg, EmbedCluster(), progress=Progress("off"), replica_cls=DiesOnceActor)
    assert (tmp_path / "ray.parquet.died").exists()  # the actor did die, on its second window
    assert report.cluster["actor_restarts_seen"] >= 1
    _same_output(local_out, tmp_path / "ray.parquet")
    assert report.rows == 416 and report.accounting["balanced"]


def test_driver_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_model, ray_address, local_run):
    inputs, local_out, _ = local_run
    out = tmp_path / "ray.parquet"
    args = [*map(str, inputs), "-o", str(out), "--model", str(tiny_model), "--sort-window", "120"]
    args += ["--max-batch-tokens", "1024", "--max-batch-size", "32", "--progress", "off", "-q"]
    ray_args = ["--engine", "ray", "--replicas", "1", "--ray-address", ray_address]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    # NOTE: the third manifest write is the second window's commit: SIGKILL there, no cleanup.
    killed = subprocess.run(
        [sys.executable, str(CRASH_RUN), "manifest_renamed", "3", *args, *ray_args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    manifest = json.loads((tmp_path / "ray.parquet.parts" / "manifest.json").read_text())
    assert [w["window"] for w in manifest["windows"]] == [0, 1]
    assert not out.exists()

    with pytest.raises(OutputError, match="option sort_window differs"):  # resuming with another option
        run_job(_ray(small_config(inputs, out, tiny_model, plan={"sort_window": 100}, output={"resume": True})))
    report, _ = run_job(_ray(small_config(inputs, out, tiny_model, output={"resume": True}), replicas=1))
    # NOTE: windows 0 and 1 (240 input rows, 3 of them rejected then) resumed; 416 rows in the output
    assert report.rows_resumed == report.accounting["rows_resumed"] == 240 and report.rows == 416 - 237
    assert report.accounting["balanced"]
    _same_output(local_out, out)


def test_ray_engine_refuses_what_it_cannot_do(tmp_path, tiny_model, requests_jsonl):
    cfg = _ray(small_config(requests_jsonl, tmp_path / "o.parquet", tiny_model))
    with pytest.raises(ConfigError, match="--rate is not available with --engine ray"):
        run_job(replace(cfg, input=replace(cfg.input, rate=10.0)))
    with pytest.raises(ConfigError, match="needs --gpus-per-replica"):
        run_job(replace(cfg, device=replace(cfg.device, device="cuda")))
    with pytest.raises(ConfigError, match="--quantize auto is not available with --engine ray"):
        run_job(replace(cfg, device=replace(cfg.device, quantize="auto")))
    with pytest.raises(ConfigError, match="a pooling task with --tp runs locally"):
        run_job(replace(cfg, device=replace(cfg.device, tensor_parallel=2)))


def test_int8_on_ray_is_int8_as_locally(tmp_path, tiny_model, ray_address):
    """Every replica calibrates on the input's first rows as a local run does: the same smoothing."""
    inputs = _inputs(tmp_path)
    int8 = DeviceConfig(quantize="int8")
    local = replace(small_config(inputs, tmp_path / "local.parquet", tiny_model), device=int8)
    run_job(local)
    run_job(_ray(replace(local, output=replace(local.output, path=str(tmp_path / "ray.parquet")))))
    ta, tb = read_output(tmp_path / "local.parquet"), read_output(tmp_path / "ray.parquet")
    assert ta.column("id").to_pylist() == tb.column("id").to_pylist()
    ea, eb = np.array(ta.column("embedding").to_pylist()), np.array(tb.column("embedding").to_pylist())
    cosine = (ea * eb).sum(1) / np.linalg.norm(ea, axis=1) / np.linalg.norm(eb, axis=1)
    assert cosine.min() > 0.999  # NOTE: a replica may time another kernel library faster than the driver's machine did
    with pytest.raises(OutputError):  # int8 is in the fingerprint on Ray too
        run_job(_ray(replace(local, output=replace(local.output, path=str(tmp_path / "ray.parquet"), resume=True),
                             device=DeviceConfig())))  # fmt: skip


def test_without_ray_installed_the_engine_says_how_to_get_it(tmp_path, tiny_model, requests_jsonl, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'hpcinfer\[ray\]'"):
        run_job(_ray(small_config(requests_jsonl, tmp_path / "o.parquet", tiny_model)))


def test_an_id_of_an_earlier_window_becomes_a_duplicate_even_where_the_replica_rejected_it_otherwise():
    from hpcinfer.files.ids import IdSet
    from hpcinfer.pipeline.cluster import drop_repeated_ids
    from hpcinfer.pipeline.replica import Committed

    seen = IdSet()
    first = Committed(0, 0, 2, ["a", "b"], np.zeros((2, 3), np.float32), [])
    assert drop_repeated_ids(seen, first, [(0, "a", 1, "f", 0), (1, "b", 2, "f", 1)]) == (first, {})
    too_long = {"row": 3, "source": "f", "row_in_file": 3, "line": 4, "id": "a", "reason": "too_long", "message": "m"}
    values = np.arange(9, dtype=np.float32).reshape(3, 3)
    second = Committed(1, 2, 4, ["b", "c", None], values, [too_long])
    admitted = [(2, "b", 3, "f", 2), (3, "a", 4, "f", 3), (4, "c", 5, "f", 4), (5, None, 6, "f", 5)]
    fixed, moved = drop_repeated_ids(seen, second, admitted)
    assert fixed.ids == ["c", None] and moved == {"f": 1}
    np.testing.assert_array_equal(fixed.values, values[1:])
    assert [(r["row"], r["reason"], r["line"]) for r in fixed.rejects] == [
        (2, "duplicate_id", 3),
        (3, "duplicate_id", 4),
    ]
    assert fixed.rejects[0]["message"] == "id 'b' appeared before"


def test_score_and_openai_embeddings_on_ray_equal_the_local_engine(tmp_path, tiny_model, ray_address):
    """Every pooling task runs on Ray as it does here: a cross-encoder's scores, and an OpenAI
    /v1/embeddings batch file's answer lines (error lines included)."""
    from tests.fixtures.tiny_classifier import build_tiny_classifier

    scorer = build_tiny_classifier(tmp_path / "ce", "bert", ("LABEL_0",), seed=2)
    texts = make_texts(120, seed=41)
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"id": i, "query": t[:20], "document": t} for i, t in enumerate(texts)]
    )
    window = {"sort_window": 40}
    _, local = run_job(small_config(pairs, tmp_path / "local.parquet", scorer, task="score", plan=window))
    _, on_ray = run_job(_ray(small_config(pairs, tmp_path / "ray.parquet", scorer, task="score", plan=window)))
    assert local.column("id").to_pylist() == on_ray.column("id").to_pylist()
    np.testing.assert_allclose(local.column("score").to_numpy(), on_ray.column("score").to_numpy(), atol=1e-6)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": t, "dimensions": 8}}
             for i, t in enumerate(texts)]  # fmt: skip
    lines[5]["body"]["input"] = []
    for i in range(0, 120, 3):  # requests of several texts: one answer line each, gathered on the driver
        lines[i]["body"]["input"] = [texts[i], texts[(i + 1) % 120][:30], texts[(i + 2) % 120]]
    lines[90]["custom_id"] = "c3"  # a repeated id in a later window: the driver rejects the request whole
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    from hpcinfer.api import run
    from hpcinfer.obs.progress import Progress

    run(small_config(batch, tmp_path / "l.jsonl", tiny_model, plan=window), progress=Progress("off"))
    run(_ray(small_config(batch, tmp_path / "r.jsonl", tiny_model, plan=window)), progress=Progress("off"))
    ours, theirs = ([json.loads(x) for x in (tmp_path / f).read_text().splitlines()] for f in ("l.jsonl", "r.jsonl"))
    assert [x["custom_id"] for x in ours] == [x["custom_id"] for x in theirs] == [line["custom_id"] for line in lines]
    assert theirs[5]["error"]["code"] == "empty_input" and theirs[90]["error"]["code"] == "duplicate_id"
    for a, b in zip(ours, theirs, strict=True):
        if a["response"] is not None:
            assert len(b["response"]["body"]["data"]) == (3 if int(a["custom_id"][1:]) % 3 == 0 else 1)
            for x, y in zip(a["response"]["body"]["data"], b["response"]["body"]["data"], strict=True):
                np.testing.assert_allclose(x["embedding"], y["embedding"], atol=1e-6)


@pytest.mark.parametrize("kind", ["sparse", "token_embeddings", "int8"])
def test_retrieval_outputs_on_ray_equal_the_local_engine(tmp_path, tiny_model, ray_address, kind):
    """Sparse vectors, token embeddings and int8 embeddings (ranges calibrated on the first window,
    which on Ray the driver commits) come out of a Ray run as out of a local one."""
    from ..unit.test_sparse import build_splade

    texts = make_texts(90, seed=17)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    over: dict = {"plan": {"sort_window": 30}}
    model = tiny_model
    if kind == "sparse":
        model = build_splade(tmp_path / "splade", seed=3)
    elif kind == "token_embeddings":
        over["embed"] = {"output_value": "token_embeddings"}
    else:
        over["embed"] = {"precision": "int8"}
    _, local = run_job(small_config(src, tmp_path / "local.parquet", model, **over))
    # NOTE: int8's replicas must each take the driver's ranges: two of them; the other outputs are a
    # replica's own, and windows from several replicas are merged alike (the first test): one
    replicas = 2 if kind == "int8" else 1
    _, on_ray = run_job(_ray(small_config(src, tmp_path / "ray.parquet", model, **over), replicas=replicas))
    assert local.num_rows == 90 and on_ray.equals(local)


def test_a_native_encoder_beyond_bert_on_ray_equals_the_local_engine(tmp_path, ray_address):
    """The replicas build the checkpoint's own architecture (ModernBERT: RoPE, sliding-window
    layers, rows packed without padding), with no backend flag, as the local engine does."""
    from tests.fixtures.tiny_encoders import build_tiny_encoder

    model = build_tiny_encoder(tmp_path, "modernbert")
    rows = [{"id": i, "text": t} for i, t in enumerate(make_texts(90, seed=19))]
    rows[11]["text"] = ""  # a reject on both
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    over: dict = {"plan": {"sort_window": 30}}
    local_report, local = run_job(small_config(src, tmp_path / "local.parquet", model, **over))
    report, on_ray = run_job(_ray(small_config(src, tmp_path / "ray.parquet", model, **over), replicas=1))
    assert local.num_rows == 89
    _same_output(tmp_path / "local.parquet", tmp_path / "ray.parquet")  # NOTE: other batches: float rounding apart
    assert report.rejects == local_report.rejects == {"empty_text": 1} and report.backend == "native"


def test_the_local_instance_a_run_starts_runs_its_workers_at_the_runs_priority():
    # Ray's own default is nice 15: beside other busy work its replicas would get a few percent of a core
    script = (
        "import os\n"
        "from hpcinfer.ray_engine.cluster import connect, import_ray\n"
        "ray = import_ray()\n"
        "assert connect(ray, None)\n"
        "print('worker niceness', ray.get(ray.remote(lambda: os.nice(0)).remote()), 'driver', os.nice(0))\n"
        "ray.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"worker niceness {os.nice(0)} driver {os.nice(0)}" in done.stdout


def test_image_rows_on_ray_equal_the_local_engine(tmp_path, ray_address):
    """--image-column with --engine ray: the replicas decode and embed as the local engine does, rejects alike."""
    from PIL import Image

    from ..fixtures.tiny_clip import build_tiny_clip

    clip = build_tiny_clip(tmp_path / "clip", "clip", seed=4)
    rows = []
    for i in range(150):
        Image.new("RGB", (20 + i % 50, 40), ((i * 5) % 256, (i * 11) % 256, 90)).save(tmp_path / f"{i}.png")
        rows.append({"id": f"p{i}", "image": f"{i}.png"})
    rows[60]["image"] = "gone.png"
    src = write_jsonl(tmp_path / "images.jsonl", rows)
    over = {"input": {"image_column": "image"}, "plan": {"sort_window": 40}}
    local, _ = run_job(small_config(src, tmp_path / "local.parquet", clip, **over))
    report, _ = run_job(_ray(small_config(src, tmp_path / "ray.parquet", clip, **over), replicas=1))
    _same_output(tmp_path / "local.parquet", tmp_path / "ray.parquet")
    assert report.rows == local.rows == 149 and report.rejects == local.rejects == {"image_missing": 1}
