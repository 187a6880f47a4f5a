"""Inputs and outputs on an object store: a real S3 API server on loopback (s3.py), the run reading
and writing through s3fs exactly as it would against AWS.

What must hold is what holds locally: the same rows, order and rejects; a run killed with SIGKILL
resumed from another process to the same output, no committed part written twice; one run per
output; and a store's failures as one-line errors naming the URI, never a credential.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from hpcinfer.config import ClusterConfig
from hpcinfer.errors import InputError, OutputError
from tests.fixtures.killed_scratch import left_by_a_killed_run

from ..conftest import generate_config, make_texts, read_output, run_job, small_config, write_jsonl, write_parquet
from .s3 import SECRET, loopback_s3, read_only_s3

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3():  # noqa: ANN201
    with loopback_s3() as server:
        yield server


@pytest.fixture(scope="module")
def shards(tmp_path_factory, s3):  # noqa: ANN001, ANN201
    """Two Parquet and two JSONL shards of 150 rows, locally and in s3://data/; a bad JSONL line in one."""
    folder = tmp_path_factory.mktemp("shards")
    texts = make_texts(600, seed=5)
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)]
    (folder / "pq").mkdir()
    (folder / "js").mkdir()
    local = {
        "parquet": [write_parquet(folder / "pq" / f"part-{k}.parquet", rows[k * 150 : (k + 1) * 150]) for k in (0, 1)],
        "jsonl": [
            write_jsonl(folder / "js" / f"part-{k}.jsonl", rows[300 + k * 150 : 300 + (k + 1) * 150]) for k in (0, 1)
        ],
    }
    with open(local["jsonl"][1], "a", encoding="utf-8") as fh:
        fh.write("{not json\n")
    s3.bucket("data")
    for kind, files in local.items():
        for f in files:
            s3.upload(f, f"s3://data/{kind}/{f.name}")
    # a dataset's own files (manifests, rejects) start with _: every read of these prefixes skips them
    s3.fs.pipe_file("s3://data/jsonl/_rejects.jsonl", b'{"text": "not an input row"}\n')
    return local


def _s3_config(inputs, out: str, model, s3, **over):  # noqa: ANN001, ANN202
    cfg = small_config([Path(".")], Path("x"), model, **over)
    paths = tuple(inputs) if isinstance(inputs, list) else (inputs,)
    return replace(
        cfg,
        input=replace(cfg.input, paths=paths),
        output=replace(cfg.output, path=out),
        storage_options=s3.options_json,
    )


def _rejects(data: bytes) -> list[dict]:
    """Reject lines with each file named by its name alone (the local run's path, the other's URI)."""
    lines = [json.loads(line) for line in data.splitlines()]
    return [{**r, "source": r["source"].rsplit("/", 1)[-1]} for r in lines]


def _no_secret_in(s3, bucket: str, *texts: str) -> None:
    for key in s3.keys(bucket):
        assert SECRET.encode() not in s3.read(f"s3://{bucket}/{key}"), key
    for text in texts:
        assert SECRET not in text


def test_embedding_from_s3_shards_to_one_object_equals_the_local_run(tmp_path, tiny_model, s3, shards):
    local_out = tmp_path / "local.parquet"
    local, want = run_job(small_config(shards["parquet"] + shards["jsonl"], local_out, tiny_model))
    s3.bucket("out-one")
    cfg = _s3_config(["s3://data/parquet/*.parquet", "s3://data/jsonl/"], "s3://out-one/emb.parquet", tiny_model, s3)
    page = "s3://out-one/emb.parquet.report.html"
    report = _run_in_process(replace(cfg, report_path=str(tmp_path / "report.json"), report_html=page))
    got = pq.read_table(io.BytesIO(s3.read("s3://out-one/emb.parquet")))
    assert got.equals(want)
    assert s3.read("s3://out-one/emb.parquet") == local_out.read_bytes()  # NOTE: the same parts, merged alike
    assert _rejects(s3.read("s3://out-one/emb.parquet.rejects.jsonl")) == _rejects(
        Path(f"{local_out}.rejects.jsonl").read_bytes()
    )
    assert "s3://data/jsonl/part-1.jsonl" in s3.read("s3://out-one/emb.parquet.rejects.jsonl").decode()
    assert report.rows == local.rows == 600 and report.rejects == local.rejects == {"malformed_json": 1}
    assert report.html_report == page and b"<html" in s3.read(page)[:400].lower()
    assert s3.keys("out-one") == ["emb.parquet", "emb.parquet.rejects.jsonl", "emb.parquet.report.html"]
    _no_secret_in(s3, "out-one", (tmp_path / "report.json").read_text())


def test_jsonl_output_and_a_dataset_prefix_equal_the_local_run(tmp_path, tiny_model, s3, shards):
    local_out = tmp_path / "local.jsonl"
    run_job(small_config(shards["jsonl"], local_out, tiny_model))
    s3.bucket("out-ds")
    _run_in_process(_s3_config("s3://data/jsonl/*.jsonl", "s3://out-ds/emb.jsonl", tiny_model, s3))
    assert s3.read("s3://out-ds/emb.jsonl") == local_out.read_bytes()

    parquet_out = tmp_path / "local.parquet"
    _, want = run_job(small_config(shards["parquet"], parquet_out, tiny_model))
    _run_in_process(_s3_config("s3://data/parquet/", "s3://out-ds/dataset/", tiny_model, s3))
    table = ds.dataset("out-ds/dataset/", filesystem=s3.fs, format="parquet").to_table()
    assert table.equals(want.cast(table.schema))
    keys = s3.keys("out-ds", "dataset/")
    assert [k for k in keys if not k.split("/")[-1].startswith("_")] == [
        f"dataset/part-{w:06d}.parquet" for w in range(3)
    ]
    manifests = [k for k in keys if "_manifest-" in k]
    assert len(manifests) == 1 and json.loads(s3.read(f"s3://out-ds/{manifests[0]}"))["complete"] is True
    # a complete dataset is an output that exists: a second run is refused, --resume has nothing to do
    with pytest.raises(OutputError, match="output exists"):
        _run_in_process(_s3_config("s3://data/parquet/", "s3://out-ds/dataset/", tiny_model, s3))
    # --overwrite starts again, and its manifests number on from the old ones: a writer still
    # counting on an old number finds it taken
    _run_in_process(
        _s3_config("s3://data/parquet/", "s3://out-ds/dataset/", tiny_model, s3, output={"overwrite": True})
    )
    again = [k for k in s3.keys("out-ds", "dataset/") if "_manifest-" in k]
    assert len(again) == 1 and again[0] > manifests[0]

    # a prefix holding someone else's objects is not taken over, nor emptied
    s3.fs.pipe_file("s3://out-ds/theirs/data.csv", b"a,b\n")
    with pytest.raises(OutputError, match="holds objects no hpcinfer run wrote"):
        _run_in_process(_s3_config("s3://data/parquet/", "s3://out-ds/theirs/", tiny_model, s3))
    assert s3.keys("out-ds", "theirs/") == ["theirs/data.csv"]


def test_a_file_uri_output_is_the_local_file(tmp_path, tiny_model, shards):
    _, want = run_job(small_config(shards["jsonl"], tmp_path / "plain.parquet", tiny_model))
    cfg = small_config(shards["jsonl"], tmp_path / "x.parquet", tiny_model)
    _run_in_process(replace(cfg, output=replace(cfg.output, path=f"file://{tmp_path}/uri.parquet")))
    assert pq.read_table(tmp_path / "uri.parquet").equals(want)


def test_generation_from_s3_jsonl_to_s3_equals_the_local_run(tmp_path, s3):
    from ..conftest import tiny_llama

    model, *_ = tiny_llama(tmp_path / "llama", seed=3, prompts=1, max_length=64, text_seed=0)
    prompts = [{"id": f"p{i}", "prompt": t} for i, t in enumerate(make_texts(24, seed=9))]
    src = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    s3.bucket("gen")
    s3.upload(src, "s3://gen/in/prompts.jsonl")
    local_out = tmp_path / "local.jsonl"
    run_job(generate_config(src, local_out, model, max_tokens=8))
    cfg = generate_config(src, Path("x"), model, max_tokens=8)
    cfg = replace(
        cfg,
        input=replace(cfg.input, paths=("s3://gen/in/prompts.jsonl",)),
        output=replace(cfg.output, path="s3://gen/out/answers.jsonl"),
        storage_options=s3.options_json,
    )
    _run_in_process(cfg)
    assert s3.read("s3://gen/out/answers.jsonl") == local_out.read_bytes()


def _run_in_process(cfg, **kwargs):  # noqa: ANN001, ANN003, ANN202
    from hpcinfer.api import run
    from hpcinfer.obs.progress import Progress

    return run(cfg, progress=Progress("off"), **kwargs)


# -- kill -9, resume, one run per output --------------------------------------------------------------


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcinfer", "run", *args]


def _committed_windows(s3, bucket: str, prefix: str) -> int:
    manifests = [k for k in s3.keys(bucket, prefix) if "_manifest-" in k]
    for key in reversed(manifests):
        try:
            return len(json.loads(s3.read(f"s3://{bucket}/{key}"))["windows"])
        except (OSError, ValueError, KeyError):
            continue
    return 0


@pytest.fixture(scope="module")
def long_input(tmp_path_factory, s3):  # noqa: ANN001, ANN201
    rows = [{"id": f"k{i}", "text": t} for i, t in enumerate(make_texts(1200, seed=13))]
    src = write_jsonl(tmp_path_factory.mktemp("long") / "in.jsonl", rows)
    s3.bucket("long")
    s3.upload(src, "s3://long/in.jsonl")
    return src


def test_kill_9_then_resume_from_another_process_writes_nothing_twice(tmp_path, tiny_model, s3, long_input):
    s3.bucket("resume", versioned=True)
    common = ["--model", str(tiny_model), "--sort-window", "60", "--commit-every", "off", "--progress", "off", "-q",
              "--storage-options", s3.options_json]  # fmt: skip
    reference = tmp_path / "reference.parquet"
    uninterrupted = subprocess.Popen(_command(str(long_input), *common, "-o", str(reference)),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    out = "s3://resume/emb/"
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**ENV, "TMPDIR": str(temp)}
    proc = subprocess.Popen(_command("s3://long/in.jsonl", *common, "-o", out), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and _committed_windows(s3, "resume", "emb/") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it was killed: {proc.communicate()[1]}"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        _, stderr = uninterrupted.communicate(timeout=300)
    finally:
        for p in (proc, uninterrupted):
            if p.poll() is None:
                p.kill()
    assert uninterrupted.returncode == 0, stderr
    committed = _committed_windows(s3, "resume", "emb/")
    assert 2 <= committed < 20, committed
    assert "emb/_lease.json" in s3.keys("resume", "emb/")  # a killed run cannot let go of its lease

    # a kill during an upload leaves the part's local spool (its lock dropped with the process):
    # the next run removes it
    left_by_a_killed_run(temp, "part")
    resumed = subprocess.run(_command("s3://long/in.jsonl", *common, "-o", out, "--resume"),
                             capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert not list(temp.glob("hpcinfer-*"))
    table = ds.dataset("resume/emb/", filesystem=s3.fs, format="parquet").to_table()
    want = pq.read_table(reference)
    assert table.equals(want.cast(table.schema))
    written = s3.versions("resume", "emb/part-")
    assert len(written) == 20, written
    # a committed window's part is never written again; one uploaded after the last commit may be
    assert all(written[f"emb/part-{w:06d}.parquet"] == 1 for w in range(committed)), written
    assert max(written.values()) <= 2, written
    assert "emb/_lease.json" not in s3.keys("resume", "emb/")
    _no_secret_in(s3, "resume", resumed.stderr, resumed.stdout)


def test_a_second_run_on_the_same_output_is_refused_while_the_first_holds_its_lease(
    tmp_path, tiny_model, s3, long_input
):
    s3.bucket("busy")
    common = ["s3://long/in.jsonl", "--model", str(tiny_model), "--sort-window", "60", "--progress", "off", "-q",
              "--storage-options", s3.options_json, "-o", "s3://busy/emb.parquet"]  # fmt: skip
    first = subprocess.Popen(_command(*common), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while (
            first.poll() is None
            and "emb.parquet.parts/_lease.json" not in s3.keys("busy")
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert first.poll() is None, f"the first run ended before it was paused: {first.communicate()[1]}"
        # NOTE: paused, so it holds its lease however slowly the second one starts (a live process,
        # its lease unexpired: the two ways a lease stays valid)
        first.send_signal(signal.SIGSTOP)
        try:
            second = subprocess.run(_command(*common), capture_output=True, text=True, env=ENV, timeout=300)
        finally:
            first.send_signal(signal.SIGCONT)
        _, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, first_err
    assert second.returncode != 0
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "another hpcinfer run (pid" in lines[0] and "s3://busy/emb.parquet" in lines[0], lines
    assert pq.read_table(io.BytesIO(s3.read("s3://busy/emb.parquet"))).num_rows == 1200


def test_a_stale_lease_is_taken_and_a_live_one_on_another_host_refuses(tmp_path, tiny_model, s3, shards):
    s3.bucket("leases")
    lease = "s3://leases/emb.parquet.parts/_lease.json"
    cfg = _s3_config("s3://data/parquet/", "s3://leases/emb.parquet", tiny_model, s3)
    s3.fs.pipe_file(lease, json.dumps({"pid": 1, "host": "elsewhere", "expires": time.time() + 600}).encode())
    with pytest.raises(OutputError, match=r"another hpcinfer run \(pid 1 on elsewhere.*lease \d+ s left"):
        _run_in_process(cfg)
    s3.fs.pipe_file(lease, json.dumps({"pid": 1, "host": "elsewhere", "expires": time.time() - 1}).encode())
    _run_in_process(cfg)  # expired: taken
    assert pq.read_table(io.BytesIO(s3.read("s3://leases/emb.parquet"))).num_rows == 300


# -- Ray --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_address():  # noqa: ANN201
    from .ray_helpers import local_ray

    yield from local_ray()


def test_ray_with_two_replicas_reads_and_writes_the_store_as_the_local_engine(
    tmp_path, tiny_model, s3, shards, ray_address
):
    local_out = tmp_path / "local.parquet"
    run_job(small_config(shards["parquet"] + shards["jsonl"], local_out, tiny_model))
    s3.bucket("ray-out")
    cfg = _s3_config(["s3://data/parquet/", "s3://data/jsonl/*.jsonl"], "s3://ray-out/emb.parquet", tiny_model, s3)
    report = _run_in_process(replace(cfg, cluster=ClusterConfig("ray", replicas=2)))
    assert report.cluster["replicas"] == 2
    got = pq.read_table(io.BytesIO(s3.read("s3://ray-out/emb.parquet")))
    want = read_output(local_out)
    assert got.column("id").equals(want.column("id"))
    import numpy as np

    np.testing.assert_allclose(np.array(got.column("embedding").to_pylist()),
                               np.array(want.column("embedding").to_pylist()), rtol=0, atol=1e-6)  # fmt: skip
    assert _rejects(s3.read("s3://ray-out/emb.parquet.rejects.jsonl")) == _rejects(
        Path(f"{local_out}.rejects.jsonl").read_bytes()
    )


# -- what goes wrong ----------------------------------------------------------------------------------


def _one_line_error(args: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(_command(*args), capture_output=True, text=True, env=env or ENV, timeout=300)
    assert proc.returncode not in (0, 1), proc.stderr  # NOTE: 1 would be an unhandled exception
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr
    return lines[0]


def test_a_missing_bucket_no_credentials_and_a_bad_option_are_one_line_errors(tmp_path, tiny_model, s3, shards):
    model = ["--model", str(tiny_model), "--progress", "off", "-q"]
    opts = ["--storage-options", s3.options_json]
    line = _one_line_error(["s3://no-such-bucket/in.jsonl", *model, *opts, "-o", str(tmp_path / "o.parquet")])
    assert "s3://no-such-bucket/in.jsonl" in line and "no such" in line
    s3.bucket("errs")
    line = _one_line_error(["s3://data/parquet/", *model, *opts, "-o", "s3://no-such-bucket/o.parquet"])
    assert "s3://no-such-bucket/o.parquet" in line and "no such bucket" in line

    bare = {k: v for k, v in ENV.items() if not k.startswith("AWS_")}
    bare |= {"AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
             "AWS_CONFIG_FILE": str(tmp_path / "none")}  # fmt: skip
    endpoint_only = json.dumps({"endpoint_url": s3.endpoint})
    line = _one_line_error(["s3://data/parquet/", *model, "--storage-options", endpoint_only, "-o",
                            str(tmp_path / "o.parquet")], env=bare)  # fmt: skip
    assert "s3://data/parquet/" in line and "no credentials found" in line
    line = _one_line_error(
        ["s3://data/parquet/", *model, "--storage-options", "{nope", "-o", str(tmp_path / "o.parquet")]
    )
    assert "--storage-options is not JSON" in line


def test_an_object_deleted_while_read_fails_in_one_line_and_keeps_the_committed_windows(tmp_path, tiny_model, s3):
    rows = [{"id": f"d{i}", "text": t * 40} for i, t in enumerate(make_texts(2000, seed=17))]
    src = write_jsonl(tmp_path / "big.jsonl", rows)  # about 9 MB: read in 1 MiB ranges
    s3.bucket("vanish")
    s3.upload(src, "s3://vanish/in.jsonl")
    out = tmp_path / "o.parquet"
    cfg = _s3_config("s3://vanish/in.jsonl", str(out), tiny_model, s3, plan={"sort_window": 100},
                     output={"commit_every": 0})  # fmt: skip
    writes = []

    def delete_after_the_first_commit(_item) -> None:  # noqa: ANN001
        writes.append(1)
        if len(writes) == 3:
            s3.fs.rm_file("s3://vanish/in.jsonl")

    with pytest.raises(InputError) as caught:
        _run_in_process(cfg, hooks={"write": delete_after_the_first_commit})
    assert "s3://vanish/in.jsonl" in str(caught.value) and "\n" not in str(caught.value)
    assert "cannot read (no such bucket or object" in str(caught.value)
    manifest = json.loads((Path(f"{out}.parts") / "manifest.json").read_text())
    assert len(manifest["windows"]) >= 1


def _listed(endpoint: str, options: dict, bucket: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(use_listings_cache=False, **{**options, "endpoint_url": endpoint})
    return sorted(path.rsplit("/", 1)[-1] for path in fs.find(bucket))


def test_a_denied_write_is_a_one_line_error_before_any_work(tmp_path, tiny_model, requests_jsonl):
    with read_only_s3({"in.jsonl": requests_jsonl.read_bytes()}) as (endpoint, options):
        args = ["s3://read-only/in.jsonl", "--model", str(tiny_model), "--progress", "off", "-q",
                "--storage-options", json.dumps(options)]  # fmt: skip
        line = _one_line_error([*args, "-o", "s3://read-only/out.parquet"])
        assert "s3://read-only/out.parquet" in line and "access denied" in line, line
        assert options["secret"] not in line
        assert _listed(endpoint, options, "read-only") == ["in.jsonl"]  # nothing was written, not even a lease
        # the same credentials read the input: a local output is written
        ok = subprocess.run(_command(*args, "-o", str(tmp_path / "o.parquet")), capture_output=True, text=True,
                            env=ENV, timeout=300)  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        assert pq.read_table(tmp_path / "o.parquet").num_rows == 300


def test_images_on_s3_by_relative_path_and_by_uri_equal_the_local_run(tmp_path, s3):
    """--image-column over a JSONL on the store naming its images relative to itself and by s3:// URI."""
    from PIL import Image

    from ..fixtures.tiny_clip import build_tiny_clip

    clip = build_tiny_clip(tmp_path / "clip", "clip", seed=6)
    s3.bucket("pics")
    (tmp_path / "local").mkdir()
    rows, local_rows = [], []
    for i in range(30):
        file = tmp_path / "local" / f"{i}.png"
        Image.new("RGB", (20 + i, 30), (i * 8, 90, 200 - i * 5)).save(file)
        s3.upload(file, f"s3://pics/set/img/{i}.png")
        rows.append({"id": i, "image": f"img/{i}.png" if i % 2 else f"s3://pics/set/img/{i}.png"})
        local_rows.append({"id": i, "image": f"{i}.png"})
    rows[9]["image"] = "img/gone.png"
    local_rows[9]["image"] = "gone.png"
    s3.upload(write_jsonl(tmp_path / "rows.jsonl", rows), "s3://pics/set/rows.jsonl")
    local_src = write_jsonl(tmp_path / "local" / "rows.jsonl", local_rows)
    over = {"input": {"image_column": "image"}}
    local, want = run_job(small_config(local_src, tmp_path / "local.parquet", clip, **over))
    cfg = small_config(Path("x"), tmp_path / "remote.parquet", clip, **over)
    cfg = replace(cfg, input=replace(cfg.input, paths=("s3://pics/set/rows.jsonl",)), storage_options=s3.options_json)
    report = _run_in_process(cfg)
    got = pq.read_table(tmp_path / "remote.parquet")
    assert got.column("id").to_pylist() == want.column("id").to_pylist()
    assert got.column("embedding").to_pylist() == want.column("embedding").to_pylist()
    assert report.rows == local.rows == 29 and report.rejects == {"image_missing": 1}
