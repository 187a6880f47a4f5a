"""hpcinfer tune on a causal LM: the search and the prefix-cache rule on constructed trials, the
request sample, a trial's passes on a tiny decoder, and the CLI from tune to `run --config`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from hpcinfer.config import GenerateConfig, InputConfig, RunConfig
from hpcinfer.engine.engine import EngineConfig
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.errors import ConfigError
from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.recipes import load_recipe
from hpcinfer.tasks.generate.requests import RequestReader
from hpcinfer.tasks.generate.tune_search import (
    GenerationSearch,
    GenerationSpace,
    NoisyGoal,
    generation_space,
    keeps_prefix_cache,
)
from hpcinfer.tasks.generate.tune_trial import GenerationTrialRunner, draw_requests
from hpcinfer.tasks.generate.tuning import generation_recipe_values
from hpcinfer.tune.command import TuneOptions, tune
from hpcinfer.tune.search import Goal, Trial
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, write_jsonl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
DEFAULT = {"max_num_batched_tokens": 2048, "max_num_seqs": 128, "prefix_cache": True}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_decoder(tmp_path_factory.mktemp("tune-gen"), "Qwen2ForCausalLM", seed=4, max_positions=128)


def landscape(best_seqs: int, best_tokens: int, off_gain: float = 0.98, spread: float = 0.0):
    """Generated tokens/s peaks at (best_seqs, best_tokens), falling 15% a doubling away from it;
    prefix caching off runs at `off_gain` times on."""
    calls: list[dict] = []

    def measure(params: dict) -> Trial:
        calls.append(params)
        distance = abs(params["max_num_seqs"].bit_length() - best_seqs.bit_length())
        distance += abs(params["max_num_batched_tokens"].bit_length() - best_tokens.bit_length())
        rate = 1000.0 * 0.85**distance * (1.0 if params["prefix_cache"] else off_gain)
        low, high = rate * (1 - spread / 2), rate * (1 + spread / 2)
        return Trial(params, tokens_per_s=rate, rows_per_s=rate / 50, low=low, high=high, spread=spread)

    return measure, calls


def space(rows: int = 512, step_tokens: int = 1 << 20) -> GenerationSpace:
    return GenerationSpace(rows, step_tokens, (4, 8, 16, 32, 64, 128, 256), (256, 512, 1024, 2048, 4096, 8192))


def test_the_search_finds_the_best_constructed_trial_and_brackets_it():
    measure, calls = landscape(best_seqs=32, best_tokens=512)
    search = GenerationSearch(measure, Goal("tokens"), space())
    best = search.run(DEFAULT)
    assert (best.params["max_num_seqs"], best.params["max_num_batched_tokens"]) == (32, 512)
    assert best.params["prefix_cache"] is True  # off is 2% slower: kept on
    seqs = {c["max_num_seqs"] for c in calls}
    assert {16, 64} <= seqs  # one step either side of the winner was measured
    tokens = {c["max_num_batched_tokens"] for c in calls if c["max_num_seqs"] == 32}
    assert {256, 1024} <= tokens
    assert calls[-1] == {**best.params, "prefix_cache": False}  # prefix caching last, at the best point
    assert len(calls) == len({tuple(sorted(c.items())) for c in calls})  # nothing measured twice
    assert len(calls) <= search.space.most_trials


def test_budgets_that_cannot_bind_on_the_sample_are_not_measured_again():
    measure, calls = landscape(best_seqs=4, best_tokens=256)
    # 20 rows: max-num-seqs 32..256 all run 20 sequences at most, as the default 128 does.
    search = GenerationSearch(measure, Goal("tokens"), space(rows=20))
    search.run(DEFAULT)
    assert not {c["max_num_seqs"] for c in calls} & {32, 64, 256}
    assert 4 in {c["max_num_seqs"] for c in calls}


def test_prefix_cache_rule_on_constructed_trials():
    goal = Goal("tokens", min_gain=0.05)
    on = Trial({}, tokens_per_s=1000.0, low=990.0, high=1010.0)
    assert keeps_prefix_cache(on, Trial({}, tokens_per_s=1040.0, low=1030.0, high=1050.0), goal)  # within 5%
    assert not keeps_prefix_cache(on, Trial({}, tokens_per_s=1100.0, low=1090.0, high=1110.0), goal)  # 8% or more
    noisy = Trial({}, tokens_per_s=1000.0, low=900.0, high=1080.0)
    assert keeps_prefix_cache(noisy, Trial({}, tokens_per_s=1100.0), goal)  # on's fastest repeat was as fast
    assert not keeps_prefix_cache(noisy, Trial({}, tokens_per_s=1150.0), goal)  # 6% above on's fastest
    assert keeps_prefix_cache(on, Trial({}, tokens_per_s=1100.0, low=1000.0, high=1200.0), goal)  # off's slowest
    assert keeps_prefix_cache(on, Trial({}, status="infeasible"), goal)
    assert not keeps_prefix_cache(Trial({}, status="infeasible"), on, goal)


def test_the_search_turns_prefix_caching_off_only_when_that_is_faster(tmp_path):
    measure, _ = landscape(best_seqs=64, best_tokens=2048, off_gain=1.25, spread=0.05)
    search = GenerationSearch(measure, Goal("tokens"), space())
    best = search.run(DEFAULT)
    assert best.params == {"max_num_batched_tokens": 2048, "max_num_seqs": 64, "prefix_cache": False}
    values = generation_recipe_values(best, RunConfig(model="m"), "cpu")
    assert values["prefix_cache"] is False and values["max_num_seqs"] == 64
    noisy, _ = landscape(best_seqs=64, best_tokens=2048, off_gain=1.25, spread=0.30)
    assert GenerationSearch(noisy, Goal("tokens"), space()).run(DEFAULT).params["prefix_cache"] is True


def test_a_step_must_win_in_every_repeat():
    goal = NoisyGoal("tokens", min_gain=0.05)
    best = Trial({}, tokens_per_s=1000.0, low=990.0, high=1010.0)
    assert goal.beats(Trial({}, tokens_per_s=1100.0, low=1090.0, high=1110.0), best)
    assert not goal.beats(Trial({}, tokens_per_s=1100.0, low=900.0, high=1300.0), best)  # its slowest lost
    assert not goal.beats(Trial({}, tokens_per_s=1100.0), Trial({}, tokens_per_s=1000.0, low=700.0, high=1100.0))
    assert goal.beats(Trial({}, tokens_per_s=1100.0), Trial({}, tokens_per_s=1000.0))  # one repeat: --min-gain
    measure, _ = landscape(best_seqs=32, best_tokens=2048, spread=0.5)  # every step gains 18%: noise here
    assert GenerationSearch(measure, goal, space()).run(DEFAULT).params == DEFAULT
    measure, _ = landscape(best_seqs=32, best_tokens=2048, spread=0.02)
    assert GenerationSearch(measure, goal, space()).run(DEFAULT).params["max_num_seqs"] == 32


def test_a_first_repeat_is_judged_against_the_best_trials_slowest_repeat():
    from hpcinfer.tasks.generate.tuning import slowest_repeat

    goal = Goal("tokens")
    assert slowest_repeat(goal, Trial({}, tokens_per_s=100.0, low=70.0, high=120.0)) == 70.0
    assert slowest_repeat(goal, Trial({}, tokens_per_s=100.0)) == 100.0
    assert slowest_repeat(goal, Trial({}, tokens_per_s=100.0, status="infeasible")) == 0.0
    assert slowest_repeat(goal, None) == 0.0


def test_the_space_is_sized_by_the_sample_and_the_kv_pool():
    by_pool = generation_space(rows=512, step_tokens=100_000, fit_rows=20, token_lo=256, token_hi=16384)
    assert by_pool.seqs == (4, 8, 16, 32) and "KV pool holds about 20" in by_pool.skipped[0]
    by_sample = generation_space(rows=40, step_tokens=1500, fit_rows=500, token_lo=256, token_hi=16384)
    assert by_sample.seqs == (4, 8, 16) and "the sample has 40 rows" in by_sample.skipped[0]
    assert by_sample.tokens == (256, 512, 1024, 2048)  # 2048 holds the whole sample: no larger budget


def test_recipes_take_a_negated_flag_positively(tmp_path):
    allowed = {"no_prefix_cache", "max_num_seqs"}
    recipe = tmp_path / "r.toml"
    recipe.write_text("[run]\nprefix-cache = false\nmax-num-seqs = 8\n")
    assert load_recipe(str(recipe), allowed) == {"no_prefix_cache": True, "max_num_seqs": 8}
    recipe.write_text("prefix-cache = 'no'\n")
    with pytest.raises(ConfigError, match="expected true or false"):
        load_recipe(str(recipe), allowed)
    recipe.write_text("prefix-cache = true\nno-prefix-cache = true\n")
    with pytest.raises(ConfigError, match="twice"):
        load_recipe(str(recipe), allowed)
    recipe.write_text("prefix-cach = true\n")
    with pytest.raises(ConfigError, match="known: max-num-seqs, no-prefix-cache, prefix-cache"):
        load_recipe(str(recipe), allowed)


def test_the_sample_reads_every_request_shape_and_leaves_rejects_out(tmp_path, ckpt):
    rows = [{"id": f"p{i}", "prompt": t, "max_tokens": 2 + i % 3} for i, t in enumerate(make_texts(8, seed=1))]
    rows += [{"id": "chat", "messages": [{"role": "user", "content": "what is paging"}]}]
    rows += [{"id": "ids", "prompt_token_ids": [101, 2000, 2001, 2002]}, {"id": "bad", "prompt": ""}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    info = inspect_decoder(ckpt)
    from hpcinfer.tasks.generate.chat import ChatRenderer

    chat = ChatRenderer(info.chat_template, info.special_tokens)
    reader = RequestReader((str(src),), "id", load_tokenizer(info), chat, SamplingParams(max_tokens=5), 100, 30522)
    sample = draw_requests(reader, 6, seed=0, scan_rows=1000, kv_tokens=4096)
    assert sample.scanned == 11 and sample.rejected == 1 and sample.rows == 6
    assert [r.row for r in sample.requests] == list(range(6))  # renumbered: windows of the sample's own rows
    everything = draw_requests(
        RequestReader((str(src),), "id", load_tokenizer(info), chat, SamplingParams(max_tokens=5), 100, 30522),
        100,
        seed=0,
        scan_rows=1000,
        kv_tokens=4096,
    )
    by_id = {r.id: r for r in everything.requests}
    assert by_id["ids"].tokens == [101, 2000, 2001, 2002] and by_id["chat"].kind == "chat"
    assert by_id["p1"].params.max_tokens == 3 and by_id["chat"].params.max_tokens == 5  # per-row, else default
    assert "10 of 11 requests" in everything.describe()


def test_each_repeat_starts_with_an_empty_prefix_cache(tmp_path, ckpt):
    shared = "the same long system preamble for every single request here " * 2
    texts = [" ".join(t.split()[:5]) for t in make_texts(6, seed=2)]
    rows = [{"id": i, "prompt": shared + t, "max_tokens": 2} for i, t in enumerate(texts)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    info = inspect_decoder(ckpt)
    tokenizer = load_tokenizer(inspect_decoder(ckpt))
    reader = RequestReader((str(src),), "id", tokenizer, None, SamplingParams(max_tokens=2), 100, 30522)
    sample = draw_requests(reader, 6, seed=0, scan_rows=100, kv_tokens=4096)
    import torch

    model = load_decoder(info, torch.device("cpu"), torch.float32)
    base = EngineConfig(kv_cache_memory=4 << 20)
    runner = GenerationTrialRunner(
        model,
        base,
        sample,
        info.eos_token_ids,
        tokenizer.decode,
        repeats=1,
        warmup_rows=0,
        window_rows=512,
        prefix_order=True,
    )
    params = {"max_num_batched_tokens": 256, "max_num_seqs": 2, "prefix_cache": True}
    first = runner.run_pass(runner.engine_config(params), sample.requests)
    second = runner.run_pass(runner.engine_config(params), sample.requests)
    assert first.rows == second.rows == 6 and first.completion_tokens == 12
    assert 0 < first.cached_tokens == second.cached_tokens < first.prompt_tokens  # not served by the first pass
    off = runner.run_pass(runner.engine_config({**params, "prefix_cache": False}), sample.requests)
    assert off.cached_tokens == 0
    trial = runner({**params, "prefix_cache": True})
    assert trial.status == "ok" and trial.repeats == 1 and trial.tokens_per_s > 0 and trial.cached_share > 0


def test_tune_reports_progress_as_trials_out_of_their_most(tmp_path, ckpt):
    rows = [{"id": i, "prompt": " ".join(t.split()[:6]), "max_tokens": 2} for i, t in enumerate(make_texts(8))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    base = RunConfig(input=InputConfig((str(src),)), model=str(ckpt), generate=GenerateConfig(kv_cache_memory="4MiB"))
    statuses: list[str] = []
    result = tune(base, TuneOptions(repeats=1, warmup_rows=2), on_trial=lambda s, t, status: statuses.append(status))
    most = result.search.space.most_trials
    running = "running max-num-batched-tokens=2048, max-num-seqs=128, prefix-cache=on: "
    assert statuses[0].startswith(f"0 of at most {most} trials done; {running}")
    assert any(s.startswith(f"1 of at most {most} trials done; running ") for s in statuses)
    assert any(s.endswith("warm-up, 2 rows") for s in statuses) and any(s.endswith("repeat 1/1") for s in statuses)
    assert sum(s == "" for s in statuses) == len(result.search.trials) <= most  # one call per finished trial
    assert result.goal.objective == "tokens" and result.best.tokens_per_s > 0


def test_latency_goals_are_refused_for_generation(tmp_path, ckpt):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x y z"}])
    base = RunConfig(input=InputConfig((str(src),)), model=str(ckpt))
    with pytest.raises(ConfigError, match="--objective latency: tune on a causal LM measures throughput"):
        tune(base, TuneOptions(objective="latency"))
    with pytest.raises(ConfigError, match="--rate"):
        tune(RunConfig(input=InputConfig((str(src),), rate=5.0), model=str(ckpt)), TuneOptions())
    with pytest.raises(ConfigError, match="--max-p99-ms"):
        tune(base, TuneOptions(max_p99_ms=100.0))
    with pytest.raises(ConfigError, match="--sample and --repeats must be at least 1"):
        tune(base, TuneOptions(sample_rows=0))


def test_tune_cli_writes_a_recipe_that_run_applies(tmp_path, ckpt):
    rows = [{"id": f"r{i}", "prompt": t, "max_tokens": 2 + i % 2} for i, t in enumerate(make_texts(16, seed=5))]
    src = write_jsonl(tmp_path / "prompts.jsonl", rows)
    recipe, trials = tmp_path / "gen.toml", tmp_path / "trials.csv"
    cmd = [sys.executable, "-m", "hpcinfer", "tune", str(src), "--model", str(ckpt), "--repeats", "1"]
    cmd += ["--warmup-rows", "2", "--kv-cache-memory", "4MiB", "--threads", "1"]
    cmd += ["--write-recipe", str(recipe), "--trials", str(trials)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "sample: 16 of 16 requests" in proc.stderr and "best:" in proc.stderr
    assert "prefix cache: " in proc.stderr and "(of at most " in proc.stderr
    swept = list(csv.DictReader(trials.open()))
    assert len(swept) >= 4 and sum(r["chosen"] == "True" for r in swept) == 1
    assert {r["prefix_cache"] for r in swept} == {"True", "False"}
    allowed = {"model", "device", "dtype", "threads", "kv_cache_memory", "max_num_batched_tokens", "max_num_seqs"}
    values = load_recipe(str(recipe), allowed | {"no_prefix_cache"})
    chosen = next(r for r in swept if r["chosen"] == "True")
    assert values["max_num_seqs"] == int(chosen["max_num_seqs"])
    assert values["max_num_batched_tokens"] == int(chosen["max_num_batched_tokens"])
    assert values["no_prefix_cache"] == (chosen["prefix_cache"] == "False")
    assert values["max_num_seqs"] in {int(r["max_num_seqs"]) for r in swept}

    # NOTE: `run` in this process (click's runner): a second interpreter would mostly import torch again.
    from click.testing import CliRunner

    from hpcinfer.cli import main

    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    args = ["run", str(src), "-o", str(out), "--config", str(recipe), "--report", str(report), "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    config = json.loads(report.read_text())["config"]
    assert config["generate.max_num_seqs"] == values["max_num_seqs"]
    assert config["generate.max_num_batched_tokens"] == values["max_num_batched_tokens"]
    assert config["generate.prefix_cache"] is not values["no_prefix_cache"]
    assert config["generate.kv_cache_memory"] == "4MiB"
    assert len(out.read_text().splitlines()) == 16
