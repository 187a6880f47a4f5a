"""hpcinfer tune: the search on a synthetic landscape, the stratified sample, trials, the CLI end to end."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcinfer.config import InputConfig, RunConfig
from hpcinfer.device.base import DeviceOutOfMemory
from hpcinfer.pipeline.report import RunReport
from hpcinfer.recipes import load_recipe
from hpcinfer.tune.command import parse_size
from hpcinfer.tune.sample import stratified_indices
from hpcinfer.tune.search import Goal, Search, Space, Trial
from hpcinfer.tune.trial import TrialRunner

from ..conftest import make_texts, write_jsonl

DEFAULT = {"max_batch_tokens": 2048, "max_batch_size": 512, "streams": 1, "staging_buffers": 2}


def landscape(peak_tokens: int = 8192, oom_above: int | None = None, mib_per_ktoken: float = 0.0):
    """rows/s peaks at `peak_tokens` (falling 20% per doubling away from it); OOM above `oom_above`."""
    calls: list[dict] = []

    def measure(params: dict) -> Trial:
        calls.append(params)
        tokens = params["max_batch_tokens"]
        if oom_above is not None and tokens > oom_above:
            return Trial(params, status="infeasible", note="out of memory")
        distance = abs(np.log2(tokens / peak_tokens))
        rate = 100.0 * 0.8**distance
        return Trial(
            params,
            rows_per_s=rate,
            tokens_per_s=rate * 90,
            p99_ms=tokens / 100,
            memory_bytes=int(tokens / 1024 * mib_per_ktoken * 2**20),
        )

    return measure, calls


def test_coarse_to_fine_finds_the_peak_and_brackets_it():
    measure, calls = landscape(peak_tokens=8192)
    search = Search(measure, Goal(), Space(token_min=256, token_max=65536, batch_sizes=(512,)))
    best = search.run(DEFAULT)
    assert best.params["max_batch_tokens"] == 8192
    tried = [c["max_batch_tokens"] for c in calls]
    assert tried[:3] == [2048, 8192, 32768]  # coarse: x4 up from the default, until no gain
    assert 4096 in tried and 16384 in tried  # fine: one x2 step either side of the winner
    assert min(tried) < 8192 < max(tried)  # the choice is bracketed, not an edge of the sweep
    assert best.gain == pytest.approx(1 / 0.8**2)


def test_gains_under_min_gain_keep_the_default():
    def flat(params: dict) -> Trial:  # +3% everywhere but the default: noise, not a win
        bonus = 1.0 if params == DEFAULT else 1.03
        return Trial(params, rows_per_s=100 * bonus, tokens_per_s=9000)

    search = Search(flat, Goal(min_gain=0.05), Space(token_min=256, token_max=65536))
    best = search.run(DEFAULT)
    assert best is search.default
    # each direction stopped after its first step: 2 coarse, 2 fine, 2 row-cap steps
    assert len(search.trials) == 1 + 2 + 2 + 2


def test_row_caps_that_never_bind_are_stepped_over_not_stopped_at():
    def measure(params: dict) -> Trial:  # only the smallest cap is faster
        return Trial(params, rows_per_s=200.0 if params["max_batch_size"] == 32 else 100.0)

    # 2048 tokens over rows of at least 32 tokens: at most 64 rows, so caps 64-1024 equal 512
    search = Search(measure, Goal(), Space(token_min=2048, token_max=2048, min_row_tokens=32))
    best = search.run(DEFAULT)
    assert best.params["max_batch_size"] == 32
    assert [t.params["max_batch_size"] for t in search.trials] == [512, 32]  # 64 is 512 here


def test_out_of_memory_trials_are_infeasible_not_fatal():
    measure, _ = landscape(peak_tokens=65536, oom_above=8192)
    search = Search(measure, Goal(), Space(token_min=256, token_max=65536, batch_sizes=(512,)))
    best = search.run(DEFAULT)
    assert best.params["max_batch_tokens"] == 8192
    infeasible = [t for t in search.trials if t.status == "infeasible"]
    assert infeasible and all(t.params["max_batch_tokens"] > 8192 for t in infeasible)


def test_memory_and_latency_limits_exclude_trials():
    measure, _ = landscape(peak_tokens=65536, mib_per_ktoken=10)
    goal = Goal(max_memory_bytes=parse_size("100MiB"), max_p99_ms=200)
    search = Search(measure, goal, Space(token_min=256, token_max=65536, batch_sizes=(512,)))
    best = search.run(DEFAULT)
    assert best.params["max_batch_tokens"] == 8192  # 16384 tokens: 160 MiB and p99 163 ms
    over = {t.params["max_batch_tokens"]: t.note for t in search.trials if t.status == "over-limit"}
    assert "memory 160 MiB > 100 MiB" in over[16384]


def test_latency_objective_prefers_lower_p99_and_refuses_saturation():
    def measure(params: dict) -> Trial:
        timeout = params["batch_timeout_ms"]
        return Trial(params, rows_per_s=50, p99_ms=30 + timeout, saturated=timeout < 5)

    space = Space(token_min=2048, token_max=2048, batch_sizes=(512,), timeouts_ms=(2.0, 5.0, 10.0, 20.0, 50.0))
    search = Search(measure, Goal(objective="latency"), space)
    best = search.run({**DEFAULT, "batch_timeout_ms": 20.0})
    assert best.params["batch_timeout_ms"] == 5.0  # 2 ms would be lower still, but cannot keep up


def test_stratified_sample_keeps_the_length_mix():
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(5, 20, 9000), rng.integers(200, 256, 1000)])  # 10% long rows
    rng.shuffle(lengths)
    picked = stratified_indices(lengths, 500, seed=0)
    assert len(picked) == 500 and np.all(np.diff(picked) > 0)  # distinct rows, in input order
    sample = lengths[picked]
    assert (sample >= 200).mean() == pytest.approx(0.10, abs=0.005)  # a head-of-file sample would miss this
    assert np.percentile(sample, 50) == pytest.approx(np.percentile(lengths, 50), abs=1)
    assert np.array_equal(stratified_indices(lengths[:100], 500, seed=0), np.arange(100))


def test_a_trial_that_runs_out_of_memory_is_recorded(tmp_path):
    def run_job(config: RunConfig) -> RunReport:
        if config.plan.max_batch_tokens > 4096 and config.input.limit is None:
            raise DeviceOutOfMemory("injected")
        return RunReport(rows=100, wall_s=1.0, real_tokens=9000)

    runner = TrialRunner(RunConfig(), tmp_path, repeats=2, warmup_rows=10, run_job=run_job)
    ok = runner(DEFAULT)
    assert ok.status == "ok" and ok.rows_per_s == 100 and ok.repeats == 2
    oom = runner({**DEFAULT, "max_batch_tokens": 8192})
    assert oom.status == "infeasible" and "out of memory" in oom.note


def test_parse_size():
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("800MB") == 800 * 2**20 and parse_size("1024") == 1024
    with pytest.raises(Exception, match="expected a size"):
        parse_size("lots")


def test_tune_cli_writes_a_recipe_that_run_accepts(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "req.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(400))])
    recipe, trials = tmp_path / "best.toml", tmp_path / "trials.csv"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    tune = [sys.executable, "-m", "hpcinfer", "tune", str(src), "--model", str(tiny_model), "--sample", "150"]
    tune += ["--repeats", "1", "--warmup-rows", "20", "--write-recipe", str(recipe), "--trials", str(trials)]
    page, report = tmp_path / "tune.html", tmp_path / "tune.json"
    tune += ["--max-p99-ms", "1000000", "--report", str(report), "--report-html", str(page)]
    proc = subprocess.run(tune, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    check_tune_page(page, json.loads(report.read_text()), trials)
    assert "sample: 150 of 400 rows" in proc.stderr and "best:" in proc.stderr
    assert "not swept: streams, staging buffers" in proc.stderr  # CPU
    rows = list(csv.DictReader(trials.open()))
    assert sum(r["chosen"] == "True" for r in rows) == 1
    # the token budget is walked both ways from the default whatever the timings: the default and
    # at least three other budgets, and no configuration is measured twice
    assert len({r["max_batch_tokens"] for r in rows}) >= 4
    assert len({(r["max_batch_tokens"], r["max_batch_size"]) for r in rows}) == len(rows)
    chosen = next(r for r in rows if r["chosen"] == "True")
    values = load_recipe(
        str(recipe),
        {
            "max_batch_tokens",
            "max_batch_size",
            "streams",
            "staging_buffers",
            "device",
            "dtype",
            "model",
            "tokenize_threads",
        },
    )
    assert values["max_batch_tokens"] == int(chosen["max_batch_tokens"])
    out = tmp_path / "out.parquet"
    run = [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(out), "--config", str(recipe), "-q"]
    proc = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert Path(out).is_file()


def test_tune_under_a_rate_sweeps_the_batch_timeout(tmp_path, tiny_model):
    from hpcinfer.config import InputConfig
    from hpcinfer.tune.command import TuneOptions, tune

    src = write_jsonl(tmp_path / "req.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(200))])
    base = RunConfig(input=InputConfig((str(src),), rate=400.0), model=str(tiny_model))
    result = tune(base, TuneOptions(sample_rows=60, repeats=1, warmup_rows=10))
    assert result.goal.objective == "latency"
    timeouts = {t.params["batch_timeout_ms"] for t in result.search.trials}
    assert len(timeouts) >= 3 and 20.0 in timeouts
    assert all(t.p99_ms > 0 for t in result.search.trials if t.status == "ok")


def test_row_caps_that_cannot_bind_are_not_measured_again():
    measure, calls = landscape(peak_tokens=2048)
    # Shortest row pads to 16 tokens: at 2048 tokens a batch holds at most 128 rows, so caps of
    # 256, 512 and 1024 plan the same batches as each other.
    space = Space(token_min=256, token_max=65536, min_row_tokens=16)
    search = Search(measure, Goal(), space)
    search.run(DEFAULT)
    caps = [c["max_batch_size"] for c in calls]
    assert caps[:5] == [512] * 5  # the default, 2 coarse and 2 fine token budgets
    assert caps[5:] == [64]  # the one cap that binds, next to the default's (a flat landscape: no gain)


def test_tune_a_reranker_on_its_pairs(tmp_path):
    """tune samples text pairs as the run reads them (query + document found by themselves)."""
    from hpcinfer.config import InputConfig
    from hpcinfer.tune.command import TuneOptions, tune
    from tests.fixtures.tiny_classifier import build_tiny_classifier

    model = build_tiny_classifier(tmp_path / "ce", "bert", ("LABEL_0",), seed=1)
    texts = make_texts(120, seed=5)
    src = write_jsonl(
        tmp_path / "pairs.jsonl", [{"id": i, "query": t[:16], "document": t} for i, t in enumerate(texts)]
    )
    result = tune(RunConfig(input=InputConfig((str(src),)), model=str(model), task="score"),
                  TuneOptions(sample_rows=60, repeats=1, warmup_rows=10))  # fmt: skip
    ok = [t for t in result.search.trials if t.status == "ok"]
    assert ok and all(t.rows_per_s > 0 for t in ok)


@pytest.mark.parametrize("kind", ["sparse", "token_embeddings", "int8"])
def test_tune_measures_the_retrieval_outputs(tmp_path, tiny_model, kind):
    """Tune's trials run the job as it will run: a SPLADE model's sparse rows, token embeddings, int8."""
    from hpcinfer.config import EmbedConfig
    from hpcinfer.tune.command import TuneOptions, tune

    from ..unit.test_sparse import build_splade

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(80, seed=3))])
    model = build_splade(tmp_path / "splade", seed=1) if kind == "sparse" else tiny_model
    embed = {"token_embeddings": EmbedConfig(output_value="token_embeddings"), "int8": EmbedConfig(precision="int8")}
    base = RunConfig(input=InputConfig((str(src),)), model=str(model), embed=embed.get(kind, EmbedConfig()))
    result = tune(base, TuneOptions(sample_rows=30, repeats=1, warmup_rows=5))
    assert result.best.rows_per_s > 0 and all(t.status == "ok" for t in result.search.trials)


def check_tune_page(page: Path, report: dict, trials_csv: Path) -> None:
    """The tune's HTML report in headless Chromium: both trial charts drawn with a point per trial
    (and the Pareto front under the p99 limit), the chosen trial the CSV's."""
    from .browser import open_report

    seen = open_report(page)
    assert seen["errors"] == [] and [u for u in seen["requests"] if not u.startswith("file:")] == []
    rows = list(csv.DictReader(trials_csv.open()))
    assert len(report["trials"]) == len(rows)
    assert seen["charts"]["trial_speed"] == [len(rows)]
    assert seen["charts"]["trial_latency"][0] == len(rows) and len(seen["charts"]["trial_latency"]) == 2
    chosen = next(r for r in rows if r["chosen"] == "True")
    assert int(seen["figures"]["best_trial"]) == report["best"] == int(chosen["trial"])
    assert int(seen["figures"]["trials"]) == len(rows)
