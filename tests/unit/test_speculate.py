"""Prompt-lookup speculative decoding (--speculative ngram): greedy answers token for token those of
one token a step, with stops (EOS, stop ids and strings, max_tokens) inside a verified run of
tokens; sampled rows untouched; proposals never reach the prefix cache; the report's rate."""

from __future__ import annotations

import json

import pytest
import torch

from hpcinfer.engine import engine as engine_module
from hpcinfer.engine import speculate
from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.engine.speculate import REST_STEPS, Speculation, propose
from hpcinfer.errors import ConfigError
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
def test_greedy_answers_equal_one_token_a_step(tiny, seqs, monkeypatch):
    _, info, model, prompts = tiny
    monkeypatch.setattr(speculate, "LOW_RATE", 0.0)  # NOTE: propose every step: a random model keeps few
    prompts = copying(prompts)
    eos = info.eos_token_ids
    params = [SamplingParams(max_tokens=7 + 5 * (i % 4), stop_token_ids=(prompts[i][3],) if i % 3 == 0 else ())
              for i in range(len(prompts))]  # fmt: skip
    plain = Engine(model, EngineConfig(max_num_seqs=seqs), eos)
    # NOTE: four sequences a step ahead, as on CUDA: steps that may carry proposals run step by step
    spec = Engine(model, EngineConfig(max_num_seqs=seqs, speculative_tokens=4, ahead=seqs > 1), eos)
    want = [(s.completion, s.finish_reason) for s in plain.generate(prompts, params)]
    got = [(s.completion, s.finish_reason) for s in spec.generate(prompts, params)]
    assert got == want
    assert spec.speculation.accepted > 0 and spec.stats.steps < plain.stats.steps  # fewer forwards
    again = [(s.completion, s.finish_reason) for s in spec.generate(prompts, params)]  # the prefix cache warm
    assert again == want


# NOTE: every token in the prompt, followed by the next: whatever an answer draws, its last token was
# seen, and the tokens after it are proposed (the prefix caches, the model's and the draft's,
# prefill the prompt once)
SPEC_PROMPT = list(range(8, 260))
SPEC_PARAMS = [SamplingParams(max_tokens=5, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(800)]


@pytest.fixture(scope="module")
def unspeculated(tmp_path_factory):  # noqa: ANN201
    """A tiny GGUF model and its 800 seeded answers drawn without speculation: both proposers'
    reference distribution, drawn once, 64 answers a step (speculation runs at most
    MOST_SPECULATING sequences; a distribution does not depend on the batch)."""
    from hpcinfer.models.decoder_checkpoint import load_decoder
    from hpcinfer.models.decoder_inspect import inspect_decoder
    from tests.fixtures.tiny_gguf import build_tiny_gguf

    info = inspect_decoder(build_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", seed=11))
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    engine = Engine(model, EngineConfig(max_num_seqs=64), info.eos_token_ids)
    return info, model, [s.completion for s in engine.generate([SPEC_PROMPT] * len(SPEC_PARAMS), SPEC_PARAMS)]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_answers_keep_their_distribution(unspeculated, proposer, monkeypatch):
    """Sampled rows speculate too (a proposal kept with the model's probability for it, else a draw
    without it): the tokens of 800 seeded answers, with and without, are one distribution (a
    chi-square test per position, on a 268-token vocabulary); proposals by prompt lookup, or by a
    draft model (the model itself: its greedy guess is the distribution's mode, kept or refused)."""
    from scipy.stats import chi2_contingency

    info, model, plain = unspeculated
    draft = model if proposer == "draft" else None
    monkeypatch.setattr(speculate, "LOW_RATE", 0.0)  # NOTE: propose every step, however few are kept
    # NOTE: 16 sequences speculating at once (4 by default) draw the 800 answers in a quarter of the
    # steps; which tokens a row draws does not depend on its neighbours
    for module in (speculate, engine_module):
        monkeypatch.setattr(module, "MOST_SPECULATING", 16)
    engine = Engine(model, EngineConfig(max_num_seqs=16, speculative_tokens=4), info.eos_token_ids, draft=draft)
    answers = {0: plain, 4: [s.completion for s in engine.generate([SPEC_PROMPT] * len(SPEC_PARAMS), SPEC_PARAMS)]}
    assert engine.speculation.proposed > 1000 and engine.speculation.accepted > 10  # both paths run
    assert engine.speculation.accepted < 0.9 * engine.speculation.proposed
    if draft is not None:  # the prompt's full blocks prefilled by the draft once, then shared
        assert engine.speculation.draft.cached >= 799 * (len(SPEC_PROMPT) // 16 * 16)
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
    for mode in ("none", "ngram", f"draft:{path}"):
        out = tmp_path / f"{mode.partition(':')[0]}.jsonl"
        report = run_generate(generate_config(src, out, path, speculative=mode, max_num_seqs=2))
        outputs[mode] = [json.loads(x) for x in out.read_text().splitlines()]
        if mode != "none":  # NOTE: the model as its own draft: its guesses are kept
            assert report.speculative["proposed"] > 0
            assert report.speculative["acceptance_rate"] > (0.9 if mode.startswith("draft") else 0)
            assert ("draft_tokens" in report.speculative) == mode.startswith("draft")
    assert outputs["ngram"] == outputs["none"] == outputs[f"draft:{path}"]


def test_a_draft_of_another_tokenizer_or_a_mistyped_mode_is_one_line(tiny, tmp_path):
    from tests.fixtures.tiny_gguf import build_tiny_gguf

    path, _, _, _ = tiny
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "the fox", "max_tokens": 2}])
    gguf = build_tiny_gguf(tmp_path / "other.gguf", seed=1)
    for mode, says in ((f"draft:{gguf}", "tokenizer is not the model's"), ("draft:", "draft:MODEL"),
                       ("eagle", "draft:MODEL"), (f"draft:{tmp_path / 'nothing'}", "draft:")):  # fmt: skip
        with pytest.raises(ConfigError, match=says):
            run_generate(generate_config(src, tmp_path / "out.jsonl", path, speculative=mode))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another tiny Llama of the same tokenizer, other weights: a draft that guesses wrong often."""
    return tiny_llama(tmp_path_factory.mktemp("draft"), seed=10, prompts=1, max_length=64, text_seed=3)[2]


@pytest.mark.parametrize("seqs", [1, 4])
@pytest.mark.parametrize("which", ["same", "other"])
def test_draft_model_greedy_answers_equal_one_token_a_step(tiny, other, seqs, which):
    """--speculative draft:MODEL: the draft's guesses verified as prompt lookup's are; with the model
    itself as the draft nearly every guess is kept, with another most are refused: the same answers."""
    _, info, model, prompts = tiny
    eos = info.eos_token_ids
    params = [SamplingParams(max_tokens=9 + 5 * (i % 4), stop_token_ids=(prompts[i][3],) if i % 3 == 0 else ())
              for i in range(len(prompts))]  # fmt: skip
    plain = Engine(model, EngineConfig(max_num_seqs=seqs), eos)
    draft = model if which == "same" else other
    spec = Engine(model, EngineConfig(max_num_seqs=seqs, speculative_tokens=4), eos, draft=draft)
    want = [(s.completion, s.finish_reason) for s in plain.generate(prompts, params)]
    assert [(s.completion, s.finish_reason) for s in spec.generate(prompts, params)] == want
    proposed, kept = spec.speculation.proposed, spec.speculation.accepted
    if which == "same":
        assert kept >= 0.9 * proposed > 0 and spec.stats.steps < plain.stats.steps
    else:
        assert proposed > 0 and kept < 0.5 * proposed
    assert not spec.speculation.draft.shadows or len(spec.speculation.draft.shadows) <= seqs
    again = [(s.completion, s.finish_reason) for s in spec.generate(prompts, params)]  # shadows dropped, redone
    assert again == want


def test_speculation_rests_while_few_proposals_are_kept(tiny, other):
    """A draft whose guesses are refused stops costing: below LOW_RATE speculation rests REST_STEPS
    steps between tries, so the run takes about the forwards of one token a step, and the same answers."""
    _, info, model, prompts = tiny
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts[:2]]
    plain = Engine(model, EngineConfig(max_num_seqs=1), info.eos_token_ids)
    spec = Engine(model, EngineConfig(max_num_seqs=1, speculative_tokens=4), info.eos_token_ids, draft=other)
    want = [s.completion for s in plain.generate(prompts[:2], params)]
    assert [s.completion for s in spec.generate(prompts[:2], params)] == want
    tries = spec.speculation.proposed
    assert spec.speculation.rate < speculate.LOW_RATE and tries < 40  # not 4 a step for 80 steps
    s = Speculation(4)
    s.record(10, 0)
    s.record(10, 0)
    assert s.resting == 0
    for _ in range(8):
        s.record(10, 0)
    assert s.resting == REST_STEPS


def test_a_draft_pool_too_full_for_a_shadow_leaves_it_without_proposals(tiny):
    """A new shadow that takes cached blocks (counted free until then) leaves less room for the
    next: the next one proposes nothing rather than failing to grow (a draft pool is tight on CUDA,
    a tenth of free memory). A pool of 10 blocks of 16: 6 cached blocks of a 97-token prompt, 4 empty."""
    from hpcinfer.engine.draft import DraftModel
    from hpcinfer.engine.kvcache.block_manager import BlockManager
    from hpcinfer.engine.sequence import Sequence

    _, _, model, _ = tiny
    draft = DraftModel(model, 16, 256, 256, 4, model.cfg.vocab_size)
    draft.blocks = draft.cache.writer = draft.runner.cache.writer = BlockManager(10, 16, prefix_cache=True)
    shared = [5 + i % 200 for i in range(97)]
    first = Sequence(0, list(shared), SamplingParams())
    assert len(draft.propose([first], [2])[0]) == 2
    draft.reset()  # its blocks stay cached, free to take
    assert draft.blocks.num_free == 10 and draft.blocks.num_cached == 6
    again, other = Sequence(1, list(shared), SamplingParams()), Sequence(2, [7] * 80, SamplingParams())
    got = draft.propose([again, other], [2, 2])
    assert len(got[0]) == 2 and got[1] == []  # the second needs 6 blocks: 3 are left beside the first's 1
    assert draft.cached == 96 and id(other) not in draft.shadows
