"""Prompt-lookup speculative decoding (--speculative ngram): greedy answers token for token those of
one token a step, with stops (EOS, stop ids and strings, max_tokens) inside a verified run of
tokens; sampled rows untouched; proposals never reach the prefix cache; the report's rate."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_sampled_answers_keep_their_distribution(tmp_path):
    """Sampled rows speculate too (a proposal kept with the model's probability for it, else a draw
    without it): the tokens of 800 seeded answers, with and without, are one distribution (a
    chi-square test per position, on a 268-token vocabulary)."""
    from scipy.stats import chi2_contingency

    from hpcinfer.models.decoder_checkpoint import load_decoder
    from hpcinfer.models.decoder_inspect import inspect_decoder
    from tests.fixtures.tiny_gguf import build_tiny_gguf

    info = inspect_decoder(build_tiny_gguf(tmp_path / "tiny.gguf", seed=11))
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    # NOTE: every token in the prompt, followed by the next: whatever an answer draws, its last token
    # was seen, and the tokens after it are proposed (the prefix cache prefills the prompt once)
    prompt = list(range(8, 260))
    params = [SamplingParams(max_tokens=5, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(800)]
    answers = {}
    for k in (0, 4):
        engine = Engine(model, EngineConfig(max_num_seqs=4, speculative_tokens=k), info.eos_token_ids)
        answers[k] = [s.completion for s in engine.generate([prompt] * len(params), params)]
        if k:
            assert engine.speculation.proposed > 1000 and engine.speculation.accepted > 10  # both paths run
    assert answers[0] != answers[4]  # NOTE: other draws; the same distribution below
    for position in range(1, 5):
        tokens = sorted({a[position] for k in answers for a in answers[k]})
        table = [[sum(a[position] == t for a in answers[k]) for t in tokens] for k in (0, 4)]
        kept = [j for j in range(len(tokens)) if table[0][j] + table[1][j] >= 10]  # NOTE: chi-square's rule
        _, p_value, _, _ = chi2_contingency([[row[j] for j in kept] for row in table])
        assert p_value > 0.001, (position, table)


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
