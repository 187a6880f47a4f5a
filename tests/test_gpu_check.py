"""The GPU check script, ready for a bare GPU machine: its faults found on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def test_the_environment_step_names_a_missing_module_before_any_work(tmp_path):
    shim = tmp_path / "shim" / "rich"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('not installed on this machine')\n")
    env = {"PYTHONPATH": str(tmp_path / "shim"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_env_check.py"), "--dry-run"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1
    assert "missing: rich" in done.stdout
    ok = subprocess.run([sys.executable, str(BENCH / "gpu_env_check.py"), "--dry-run"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for name in ("click", "tqdm", "safetensors", "sentence_transformers"):
        assert name in ok.stdout


def test_the_steps_file_fails_a_run_where_a_step_did_not_run(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from gpu_steps import main
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "steps.json"
    names = ["environment", "checkpoint", "checks", "multi-device", "benchmark", "generation", "tensor-parallel"]
    every = [f"{name} ok {i}" for i, name in enumerate(names)]
    assert main([str(out), "1", *every]) == 0
    assert [s["step"] for s in json.loads(out.read_text())["steps"]] == [line.split()[0] for line in every]
    assert main([str(out), "1", *every[:3], "multi-device failed 4"]) == 1
    assert main([str(out), "1", *every[:2]]) == 1


def test_the_tiny_decoder_builds_without_the_packaged_model(tmp_path, monkeypatch):
    from hpcinfer.models import tiny_decoder

    def no_package(_name):
        raise AssertionError("the GPU machine has no packaged model")

    monkeypatch.setattr(tiny_decoder, "resolve_model_path", no_package)
    path = tiny_decoder.build_tiny_decoder(tmp_path / "d", tokenizer_dir=BENCH / "minilm_tokenizer")
    assert (path / "tokenizer.json").read_bytes() == (BENCH / "minilm_tokenizer" / "tokenizer.json").read_bytes()


def test_the_multi_device_generation_check_sizes_its_kv_pool(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import multi_device_check
    finally:
        sys.path.remove(str(BENCH))
    import hpcinfer.api

    seen = []

    def capture(config, **_kw):
        seen.append(config)
        raise RuntimeError("stop here")

    monkeypatch.setattr(hpcinfer.api, "run", capture)
    assert multi_device_check.generation_check(tmp_path, "cpu,cpu", "cpu", 2, exact=True) is False
    assert seen and seen[0].generate.kv_cache_memory is not None


def test_one_visible_gpu_is_said_not_to_be_a_multi_device_result(monkeypatch, capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import multi_device_check
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(multi_device_check, "visible_gpus", lambda: 1)
    monkeypatch.setattr(multi_device_check, "hpcinfer", lambda *a: subprocess.CompletedProcess(a, 1, "", "no GPU"))
    assert multi_device_check.main(["--model", "unused", "--rows", "1"]) == 1
    assert "--devices all is cuda:0 alone" in capsys.readouterr().out


def test_the_gpu_embedding_benchmark_runs_steady_work_for_every_setting(monkeypatch):
    # the sample corpus is 3,000 rows: on a GPU one pass is mostly start-up and drain
    monkeypatch.syspath_prepend(str(BENCH))
    from bench_embed import Corpus, parse_variants, tiled

    corpus = tiled(Corpus(["a", "b", "c"], ["x", "y", "z"], True, BENCH), 4)
    assert corpus.texts == ["a", "b", "c"] * 4 and corpus.ids == list(range(12)) and not corpus.has_ids
    assert parse_variants("streams=1,graphs=0;streams=2,graphs=1") == [
        {"streams": 1, "graphs": 0},
        {"streams": 2, "graphs": 1},
    ]
    script = (BENCH / "gpu_check.sh").read_text()
    gpu_size = script[script.index("DEVICE=cuda") :]
    assert "--tile 40" in gpu_size and "--repeats 2" in gpu_size  # 120,000 rows, two rounds
    assert "streams=1,graphs=0;streams=2,graphs=0;streams=2,graphs=1" in gpu_size
