"""`hpcinfer run` on a causal LM: answers in input order, equal to transformers; rejects; resume; OpenAI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import transformers

from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.tasks.generate.job import run_generate, wants_generation
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, read_output, write_jsonl, write_parquet

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("gen"), "Qwen2ForCausalLM", seed=4, max_positions=128)


def config(inputs, out, model, **gen) -> RunConfig:
    return RunConfig(
        input=InputConfig((str(inputs),)),
        model=str(model),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        generate=GenerateConfig(**{"max_tokens": 8, "window_rows": 5, "kv_cache_memory": "8MiB", **gen}),
    )


def test_a_causal_lm_generates_by_default(ckpt, tiny_model):
    assert wants_generation(RunConfig(input=InputConfig(("x",)), model=str(ckpt)))
    assert not wants_generation(RunConfig(input=InputConfig(("x",)), model=str(tiny_model)))
    assert not wants_generation(RunConfig(input=InputConfig(("x",)), model=str(ckpt), task="embed"))


def test_answers_in_input_order_equal_transformers(tmp_path, ckpt):
    texts = make_texts(17, seed=3)
    rows = [{"id": f"r{i}", "prompt": t, "max_tokens": 3 + (i * 7) % 13} for i, t in enumerate(texts)]
    src = write_parquet(tmp_path / "in.parquet", rows, row_group_size=4)
    out = tmp_path / "out.parquet"
    report = run_generate(config(src, out, ckpt, max_num_seqs=4))
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [r["id"] for r in rows]
    assert report.rows == 17 and report.windows == 4 and report.completion_tokens > 17
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(ckpt)
    ref = transformers.Qwen2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for row, got in zip(rows, table.to_pylist(), strict=True):
        ids = tok(row["prompt"])["input_ids"]
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=row["max_tokens"], do_sample=False)[0, len(ids) :]
        gen = gen.tolist()
        stopped = 102 in gen
        gen = gen[: gen.index(102)] if stopped else gen
        assert got["text"] == tok.decode(gen, skip_special_tokens=True)
        assert got["finish_reason"] == ("stop" if stopped else "length")
        assert got["prompt_tokens"] == len(ids)
        assert got["completion_tokens"] == len(gen) + stopped


def test_chat_rows_and_rejects(tmp_path, ckpt):
    chat = [{"role": "user", "content": "what is paging"}]
    rows = [
        {"id": "chat", "messages": chat},
        {"id": "long", "prompt": " ".join(["fox"] * 200)},
        {"id": "top_p", "prompt": "x y", "top_p": 1.5},
        {"id": "badchat", "messages": [{"content": "no role"}]},
        {"id": "ids", "prompt_token_ids": [101, 2054, 2003]},
        {"id": "ids", "prompt": "a repeated id"},
        {"id": "none"},
        {"id": "types", "prompt": "x", "max_tokens": "many"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    report = run_generate(config(src, out, ckpt))
    got = read_output(out).to_pylist()
    assert [r["id"] for r in got] == ["chat", "ids"]
    want = transformers.PreTrainedTokenizerFast.from_pretrained(ckpt).apply_chat_template(
        chat, add_generation_prompt=True
    )
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert got[0]["prompt_tokens"] == len(want)
    rejects = [json.loads(x) for x in Path(str(out) + ".rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [
        ("long", "too_long"),
        ("top_p", "invalid_sampling"),
        ("badchat", "bad_chat"),
        ("ids", "duplicate_id"),
        ("none", "invalid_request"),
        ("types", "invalid_request"),
    ]
    assert report.rows + sum(report.rejects.values()) == len(rows)


def test_openai_batch_in_and_out(tmp_path, ckpt):
    rows = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "the fox", "max_tokens": 4}},
        {
            "custom_id": "c2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
        },
    ]
    src = write_jsonl(tmp_path / "batch.jsonl", rows)
    out = tmp_path / "answers.jsonl"
    run_generate(config(src, out, ckpt))
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["c1", "c2"]
    first, second = (g["response"] for g in got)
    assert first["status_code"] == 200 and first["body"]["object"] == "text_completion"
    assert isinstance(first["body"]["choices"][0]["text"], str)
    assert first["body"]["usage"]["completion_tokens"] <= 4
    assert second["body"]["object"] == "chat.completion"
    assert second["body"]["choices"][0]["message"]["role"] == "assistant"
    usage = second["body"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_responses_bodies_answer_as_the_same_chat(tmp_path, ckpt):
    from openai.types.responses import Response

    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"}],
            "max_tokens": 5}  # fmt: skip
    lines = [
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "text", "url": "/v1/responses",
         "body": {"model": "mine", "instructions": "be brief", "input": "the fox", "max_output_tokens": 5,
                  "metadata": {"team": "a"}}},
        {"custom_id": "parts", "url": "/v1/responses",
         "body": {"input": [{"role": "developer", "content": "be brief"},
                            {"type": "message", "role": "user",
                             "content": [{"type": "input_text", "text": "the fox"}]}],
                  "max_output_tokens": 5}},
        {"custom_id": "tools", "url": "/v1/responses",
         "body": {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}},
        {"custom_id": "image", "url": "/v1/responses",
         "body": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "file://x.png"}]}]}},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "batch.jsonl", [{"method": "POST", **x} for x in lines])
    out = tmp_path / "answers.jsonl"
    run_generate(config(src, out, ckpt))
    got = {g["custom_id"]: g for g in map(json.loads, out.read_text().splitlines())}
    expected = got["chat"]["response"]["body"]
    for key in ("text", "parts"):  # NOTE: the same chat, read from a Responses body: the same greedy answer
        response = Response.model_validate(got[key]["response"]["body"])
        assert response.output_text == expected["choices"][0]["message"]["content"]
        assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
        assert response.usage.output_tokens == expected["usage"]["completion_tokens"]
        cut = expected["choices"][0]["finish_reason"] == "length"
        assert response.status == ("incomplete" if cut else "completed")
    text = Response.model_validate(got["text"]["response"]["body"])
    assert text.model == "mine" and text.instructions == "be brief" and text.metadata == {"team": "a"}
    assert got["tools"]["error"]["code"] == got["image"]["error"]["code"] == "invalid_request"
    assert "tools" in got["tools"]["error"]["message"] and "input_image" in got["image"]["error"]["message"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcinfer", "run", *args]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A Gemma 3 (sliding-window layers of 8 tokens, crossed by every prompt): a family beyond Llama's."""
    windows = {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    return build_tiny_decoder(
        tmp_path_factory.mktemp("gemma3"), "Gemma3ForCausalLM", seed=4, max_positions=128, **windows
    )


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_kill_9_then_resume_is_identical(tmp_path, request, family):
    ckpt = request.getfixturevalue("ckpt" if family == "qwen2" else family)
    rows = []
    for i, t in enumerate(make_texts(60, seed=8)):
        row = {"id": f"r{i}", "prompt": t, "max_tokens": 4 + i % 9}
        if i % 3 == 1:
            row.update(temperature=0.9, top_p=0.9, seed=i)
        elif i % 3 == 2:
            row.update(temperature=1.0)  # unseeded: the run seed and the row number decide
        rows.append(row)
    rows[13]["top_k"] = -1  # a reject that must survive the kill
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    args = [str(src), "--model", str(ckpt), "--window-rows", "3", "--max-num-seqs", "4", "--threads", "1"]
    args += ["--kv-cache-memory", "8MiB", "--progress", "off", "-q"]
    ref = tmp_path / "ref.jsonl"
    assert subprocess.run(_cli(*args, "-o", str(ref)), env=ENV, capture_output=True, timeout=300).returncode == 0
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_cli(*args, "-o", str(out)), env=ENV, stderr=subprocess.PIPE)
    manifest = Path(str(out) + ".parts") / "manifest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len(json.loads(manifest.read_text())["windows"]) >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    committed = len(json.loads(manifest.read_text())["windows"])
    assert 3 <= committed < 20
    done = subprocess.run(_cli(*args, "-o", str(out), "--resume"), env=ENV, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == ref.read_text()
    assert Path(str(out) + ".rejects.jsonl").read_text() == Path(str(ref) + ".rejects.jsonl").read_text()
    assert len(out.read_text().splitlines()) == 59


def test_a_small_kv_pool_bounds_the_prompt(tmp_path, ckpt):
    rows = [{"id": "short", "prompt": "the fox"}, {"id": "long", "prompt": " ".join(["fox"] * 60)}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16 floats
    report = run_generate(config(src, out, ckpt, kv_cache_memory=str(3 * block)))  # 48 tokens
    assert report.kv_blocks == 3 and [r["id"] for r in read_output(out).to_pylist()] == ["short"]
    assert report.rejects == {"too_long": 1}


def test_ctrl_c_keeps_committed_windows_and_says_how_to_resume(tmp_path, ckpt):
    rows = [{"id": i, "prompt": t} for i, t in enumerate(make_texts(80, seed=2))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = [str(src), "--model", str(ckpt), "--window-rows", "2", "--max-num-seqs", "2", "--threads", "1"]
    proc = subprocess.Popen(
        _cli(*args, "--progress", "off", "-o", str(out)), env=ENV, stderr=subprocess.PIPE, text=True
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


def test_generation_reads_rows_as_embedding_does_and_balances_its_books(tmp_path, ckpt):
    """A BOM, a line longer than a read chunk, a null id, an id that is a list, a lone surrogate."""
    lines = [
        json.dumps({"id": "a", "prompt": "the quick brown fox"}),
        json.dumps({"id": None, "prompt": "word " * 300_000}),  # 1.5 MB, past the 1 MiB read chunk
        json.dumps({"id": ["list"], "prompt": "x"}),
        json.dumps({"id": 0, "prompt": "zero"}),
        json.dumps({"id": None, "prompt": "another null"}),
        json.dumps({"id": "b", "prompt": "bad \ud800 text"}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    out = tmp_path / "out.parquet"
    report = run_generate(config(src, out, ckpt, max_tokens=2))
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ["a", "0", None]
    rejects = [json.loads(x) for x in Path(f"{out}.rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == [(2, "too_long"), (3, "invalid_id"), (6, "invalid_request")]
    assert report.accounting["rows_read"] == 6 and report.accounting["rows_written"] == 3


def test_one_device_given_as_devices_runs_the_plain_loop(tmp_path, ckpt):
    """Several devices are tested in test_generate_devices.py; one listed device is the one-device run."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello"}])
    cfg = config(src, tmp_path / "out.parquet", ckpt)
    cfg = RunConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "device": DeviceConfig(devices="cpu")})
    report = run_generate(cfg)
    assert report.rows == 1 and report.device == "cpu"
    assert [d["device"] for d in report.devices] == ["cpu"] and report.devices[0]["rows"] == 1


def test_profile_ranges_wrap_every_engine_step(tmp_path, ckpt):
    from hpcinfer.obs.profile import RecordingRanges

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": t} for i, t in enumerate(make_texts(9))])
    ranges = RecordingRanges()
    report = run_generate(config(src, tmp_path / "out.parquet", ckpt, max_tokens=4), ranges=ranges)
    pushes = [name for _, kind, name in ranges.events if kind == "push"]
    assert len(pushes) == report.steps > 0
    assert all(name.startswith("hpcinfer/engine_step step=") for name in pushes)
    assert [kind for _, kind, _ in ranges.events] == ["push", "pop"] * report.steps  # balanced, one at a time
