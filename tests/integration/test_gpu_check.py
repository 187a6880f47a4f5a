"""The GPU check script, ready for a bare GPU machine: its faults found on the CPU."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
GPU_CHECK = BENCH / "gpu_check"  # the GPU check's Python steps; gpu_check.sh itself stays in BENCH


def test_the_environment_step_names_a_missing_module_before_any_work(tmp_path, monkeypatch, capsys):
    # NOTE: torch and the transformers pair missing too: every missing one is named, and the
    # interpreter is spared their imports (most of this test's time when they were there)
    absent = ("torch", "rich", "transformers", "sentence_transformers")
    for name in absent:
        shim = tmp_path / "shim" / name
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("raise ImportError('not installed on this machine')\n")
    env = {"PYTHONPATH": str(tmp_path / "shim"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(GPU_CHECK / "gpu_env_check.py"), "--dry-run"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1 and "missing: " in done.stdout, done.stdout
    named = done.stdout.split("missing: ", 1)[1]
    assert [part.split(" (")[0] for part in named.strip().split("; ")] == list(absent), done.stdout
    assert "numpy " in done.stdout and "pyarrow " in done.stdout  # the others' versions, as usual
    # NOTE: where nothing is missing, in this process (its modules are the same; a second
    # interpreter importing all of them again took most of this test's time)
    assert _bench(monkeypatch, "gpu_check.gpu_env_check").main(["--dry-run", "--json", str(tmp_path / "env.json")]) == 0
    shown = capsys.readouterr().out
    assert "missing" not in shown
    for name in ("click", "tqdm", "safetensors", "sentence_transformers"):
        assert name in shown
    assert json.loads((tmp_path / "env.json").read_text())["modules"]["rich"]


def _bench(monkeypatch: pytest.MonkeyPatch, name: str):  # noqa: ANN202
    # NOTE: benchmarks/ is a package under the repository's root, which pytest puts on sys.path
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module(f"benchmarks.{name}")


def test_the_verdict_fails_a_run_where_a_step_did_not_run_and_pass(tmp_path, monkeypatch):
    gpu_steps = _bench(monkeypatch, "gpu_check.gpu_steps")
    out = tmp_path / "steps.json"

    def verdict(steps: list[tuple[str, str]]) -> int:
        out.write_text(json.dumps({"steps": [{"step": n, "status": st, "seconds": 1} for n, st in steps]}))
        return gpu_steps.main([str(out)])

    every = [(name, "ok") for name in gpu_steps.EXPECTED]
    assert verdict(every) == 0
    assert verdict([*every[:3], ("collectives", "killed"), *every[4:]]) == 1
    assert verdict(every[:2]) == 1


def _fake_python(tmp_path: Path, body: str) -> Path:
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    return fake


def _steps(out: Path) -> dict:
    return json.loads((out / "steps.json").read_text())


def test_a_failing_environment_still_leaves_steps_json(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(out), str(_fake_python(tmp_path, "exit 3"))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    steps = _steps(out)
    assert steps["finished"] is True and [(s["step"], s["status"]) for s in steps["steps"]] == [
        ("environment", "failed")
    ]
    assert (out / "gpu_check.log").is_file() and not list(out.glob(".*.tmp"))


def test_a_run_stopped_mid_step_leaves_steps_json_and_ends_the_step(tmp_path):
    # NOTE: the whole process group is signalled, as a lease ending would; the step's own process
    # group (timeout's) must end with it, not run on
    out, flag = tmp_path / "out", tmp_path / "still-running"
    fake = _fake_python(tmp_path, f"sleep 1; while true; do touch {flag}; sleep 0.2; done")
    run = subprocess.Popen(
        ["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(out), str(fake)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _steps(out)["steps"][-1]["status"] == "running"
    os.killpg(run.pid, signal.SIGTERM)
    assert run.wait(timeout=30) != 0
    steps = _steps(out)
    assert steps["finished"] is False and steps["steps"][-1]["status"] == "killed", steps
    flag.unlink()
    time.sleep(1.0)
    assert not flag.exists(), "the step went on running after the check was stopped"


def test_results_are_written_whole_and_a_failure_is_recorded_while_the_rest_go_on(tmp_path, monkeypatch):
    results = _bench(monkeypatch, "gpu_check.gpu_results")
    path = tmp_path / "r.json"
    results.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    now = results.Deadline(None)
    assert results.attempt("fine", lambda: 5, now) == (5, None)
    out, failed = results.attempt("broken", lambda: 1 / 0, now)
    assert out is None and failed["status"] == "error" and "ZeroDivisionError" in failed["error"]
    out, skipped = results.attempt("late", lambda: 5, results.Deadline(-1))
    assert out is None and skipped["status"] == "skipped"


def test_a_generation_engine_that_fails_is_recorded_and_the_others_are_measured(tmp_path, monkeypatch):
    bench = _bench(monkeypatch, "speed.bench_generate")
    real = bench.run_hpcinfer

    def broken_on_fp8(model, prompts, max_tokens, args, variant):  # noqa: ANN001, ANN202
        if variant["quantize"] == "fp8":
            raise RuntimeError("injected")
        return real(model, prompts, max_tokens, args, variant)

    monkeypatch.setattr(bench, "run_hpcinfer", broken_on_fp8)
    out = tmp_path / "generate.json"
    argv = ["--device", "cpu", "--shape", "tiny-llama", "--prompts", "4", "--prompt-lengths", "8,24"]
    argv += ["--new-tokens", "2,6", "--kv-cache-memory", "16MiB", "--probe", "2,8,3", "--skip-static", "--skip-cb"]
    argv += ["--variants", "attention=torch,graphs=0;quantize=fp8;attention=torch,graphs=1", "--json", str(out)]
    assert bench.main(argv) == 1
    engines = json.loads(out.read_text())["engines"]
    assert [e["status"] for e in engines] == ["ok", "error", "ok"]
    assert "injected" in engines[1]["error"]
    for e in (engines[0], engines[2]):
        assert e["dtype"] == "float32" and e["same_greedy_tokens"] == 4
        assert e["decode_step_ms"] > 0 and e["decode_bandwidth_utilisation"] > 0 and "gpu_busy_share" in e


def test_flops_match_torchs_flop_counter(monkeypatch):
    # NOTE: the independent count: torch's FlopCounterMode over transformers' own models (eager
    # attention, which computes every score); the benchmark counts a causal decoder's half
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    models = _bench(monkeypatch, "gpu_check.gpu_models")
    n, layers = 37, 2
    bert = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": layers, "num_attention_heads": 4}
    bert |= {"intermediate_size": 64}
    qwen = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4}
    qwen |= {"num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
    built = [
        (bert, transformers.BertModel(transformers.BertConfig(vocab_size=100, attn_implementation="eager", **{
            k: v for k, v in bert.items() if k != "model_type"}), add_pooling_layer=False)),
        (qwen, transformers.Qwen3Model(transformers.Qwen3Config(vocab_size=100, attn_implementation="eager", **{
            k: v for k, v in qwen.items() if k != "model_type"}))),
    ]  # fmt: skip
    for config, model in built:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            model.eval()(torch.randint(0, 100, (1, n)))
        causal_half = 4 * layers * 4 * 16 * (n * n - n * (n + 1) // 2) if config is qwen else 0
        assert models.forward_flops(config, [n]) == counter.get_total_flops() - causal_half


def test_the_collectives_step_runs_the_groups_path_at_world_size_one(tmp_path, monkeypatch):
    collectives = _bench(monkeypatch, "gpu_check.gpu_collectives")
    out = tmp_path / "collectives.json"
    assert collectives.main(["--device", "cpu", "--mib", "0.25", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "gloo" and result["world"] == 1
    assert set(result["ops"]) == {"all_reduce", "all_gather", "gather", "broadcast", "all_min"}
    assert all(op["status"] == "ok" for op in result["ops"].values())


def test_with_one_gpu_the_tensor_parallel_step_says_skipped_at_once(tmp_path, monkeypatch):
    import torch

    tp_check = _bench(monkeypatch, "gpu_check.tp_check")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "tp.json"
    assert tp_check.main(["--device", "cuda", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"status": "skipped", "reason": "1 GPU"}


def test_the_tiny_decoder_builds_without_the_packaged_model(tmp_path, monkeypatch):
    from tests.fixtures import tiny_decoder

    def no_package(_name):
        raise AssertionError("the GPU machine has no packaged model")

    monkeypatch.setattr(tiny_decoder, "resolve_model_path", no_package)
    path = tiny_decoder.build_tiny_decoder(tmp_path / "d", tokenizer_dir=BENCH / "minilm_tokenizer")
    assert (path / "tokenizer.json").read_bytes() == (BENCH / "minilm_tokenizer" / "tokenizer.json").read_bytes()


def test_the_multi_device_generation_check_sizes_its_kv_pool(tmp_path, monkeypatch):
    multi_device_check = _bench(monkeypatch, "gpu_check.multi_device_check")
    import hpcinfer.api

    seen = []

    def capture(config, **_kw):
        seen.append(config)
        raise RuntimeError("stop here")

    monkeypatch.setattr(hpcinfer.api, "run", capture)
    assert multi_device_check.generation_check(tmp_path, "cpu,cpu", "cpu", 2, exact=True) is False
    assert seen and seen[0].generate.kv_cache_memory is not None


def test_with_one_gpu_the_multi_device_step_says_skipped_at_once(monkeypatch, capsys):
    multi_device_check = _bench(monkeypatch, "gpu_check.multi_device_check")

    def no_run(*args: str) -> None:
        raise AssertionError("nothing multi-device to measure on one GPU")

    monkeypatch.setattr(multi_device_check, "visible_gpus", lambda: 1)
    monkeypatch.setattr(multi_device_check, "hpcinfer", no_run)
    assert multi_device_check.main(["--model", "unused", "--rows", "1"]) == 0
    assert "skipped: 1 GPU visible" in capsys.readouterr().out


def test_the_gpu_embedding_benchmark_runs_steady_work_for_every_setting(monkeypatch):
    # the sample corpus is 3,000 rows: on a GPU one pass is mostly start-up and drain
    bench_embed = _bench(monkeypatch, "speed.bench_embed")
    Corpus, parse_variants, tiled = bench_embed.Corpus, bench_embed.parse_variants, bench_embed.tiled

    corpus = tiled(Corpus(["a", "b", "c"], ["x", "y", "z"], True, BENCH), 4)
    assert corpus.texts == ["a", "b", "c"] * 4 and corpus.ids == list(range(12)) and not corpus.has_ids
    assert parse_variants("streams=1,graphs=0;streams=2,graphs=1") == [
        {"streams": 1, "graphs": 0},
        {"streams": 2, "graphs": 1},
    ]
    script = (BENCH / "gpu_check.sh").read_text()
    gpu_size = script[script.index("BUDGET=560") :]
    assert "--tile 5" in gpu_size and "--repeats 2" in gpu_size  # 15,000 rows, two rounds
    assert "BERT=bert-large DECODER=qwen3-0.6b" in gpu_size
    assert "unset TOKENIZERS_PARALLELISM" in script and "export TOKENIZERS_PARALLELISM" not in script


def test_the_h200_estimates_add_up_to_under_eight_minutes():
    script = (BENCH / "gpu_check.sh").read_text()
    estimates = [int(line.split()[2]) for line in script.splitlines() if line.startswith("step ")]
    assert len(estimates) == 10 and sum(estimates) < 8 * 60
    assert f"= {sum(estimates)} s" in script  # the figure the comment gives is the steps' own
