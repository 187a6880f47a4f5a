"""Prompt-lookup speculative decoding (--speculative ngram): greedy answers token for token those of
one token a step, with stops (EOS, stop ids and strings, max_tokens) inside a verified run of
tokens; sampled rows untouched; proposals never reach the prefix cache; the report's rate."""

from __future__ import annotations

import json

import pytest

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.engine.speculate import propose
from hpcinfer.tasks.generate.job import run_generate

from ..conftest import generate_config, tiny_llama, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("spec"), seed=9, prompts=12, max_length=64, text_seed=3)


def test_proposals_follow_the_latest_earlier_ngram():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest match of (1, 2, 3)
    assert propose([5, 6, 7, 5, 6], 4) == [7, 5, 6]  # shorter n-grams when the longer never occurred
    assert propose([1, 2, 3, 4], 3) == [] and propose([4, 4], 0) == []


def copying(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts that repeat a span of themselves: a greedy answer often copies, so proposals get kept."""
    return [p + p[1:9] + p[1:5] for p in prompts]


@pytest.mark.parametrize("seqs", [1, 4])
def test_greedy_answers_equal_one_token_a_step(tiny, seqs):
    _, info, model, prompts = tiny
    prompts = copying(prompts)
    eos = info.eos_token_ids
    params = [SamplingParams(max_tokens=7 + 5 * (i % 4), stop_token_ids=(prompts[i][3],) if i % 3 == 0 else ())
              for i in range(len(prompts))]  # fmt: skip
    plain = Engine(model, EngineConfig(max_num_seqs=seqs), eos)
    spec = Engine(model, EngineConfig(max_num_seqs=seqs, speculative_tokens=4), eos)
    want = [(s.completion, s.finish_reason) for s in plain.generate(prompts, params)]
    got = [(s.completion, s.finish_reason) for s in spec.generate(prompts, params)]
    assert got == want
    assert spec.speculation.accepted > 0 and spec.stats.steps < plain.stats.steps  # fewer forwards
    again = [(s.completion, s.finish_reason) for s in spec.generate(prompts, params)]  # the prefix cache warm
    assert again == want


def test_sampled_rows_decode_as_without_it(tiny):
    _, info, model, prompts = tiny
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=i) for i in range(4)]
    runs = []
    for k in (0, 4):
        engine = Engine(model, EngineConfig(max_num_seqs=4, speculative_tokens=k), info.eos_token_ids)
        runs.append([s.completion for s in engine.generate(copying(prompts)[:4], params)])
    assert runs[0] == runs[1]


def test_a_job_with_speculation_writes_the_same_answers_and_its_rate(tiny, tmp_path):
    path, _, _, _ = tiny
    rows = [{"id": i, "prompt": f"the fox {'and the dog ' * (1 + i % 3)}jumps over the fox and the", "max_tokens": 16,
             **({"stop": ["dog dog"]} if i % 4 == 1 else {})} for i in range(8)]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    outputs = {}
    for mode in ("none", "ngram"):
        out = tmp_path / f"{mode}.jsonl"
        report = run_generate(generate_config(src, out, path, speculative=mode, max_num_seqs=2))
        outputs[mode] = [json.loads(x) for x in out.read_text().splitlines()]
    assert outputs["ngram"] == outputs["none"]
    assert report.speculative["proposed"] > 0 and 0 <= report.speculative["acceptance_rate"] <= 1
