"""Sampling: filters against transformers' logits warpers, seeds independent of the batch, stop rules."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sample.sampling import Sampler, candidates, filtered_probs, greedy
from hpcinfer.engine.sequence import SamplingParams, Sequence
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.registry import load_tokenizer
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_decoder(tmp_path_factory.mktemp("llama"), seed=2)
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(path, 256)
    prompts = [tokenizer.encode(t).ids for t in make_texts(24, seed=9)]
    return model, info, tokenizer, prompts


def engine(tiny, **over) -> Engine:
    model, info, tokenizer, _ = tiny
    cfg = EngineConfig(**{"max_num_seqs": 32, "max_num_batched_tokens": 256, "kv_cache_memory": 32 << 20, **over})
    return Engine(model, cfg, info.eos_token_ids, decode=lambda ids: tokenizer.decode(ids))


@pytest.mark.parametrize(
    ("params", "warpers"),
    [
        (SamplingParams(temperature=0.7, top_k=5), [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]),
        (SamplingParams(temperature=1.3, top_p=0.8), [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.8)]),
        (SamplingParams(temperature=1.0, min_p=0.2), [MinPLogitsWarper(0.2)]),
        (
            SamplingParams(temperature=0.9, top_k=20, top_p=0.5),
            [TemperatureLogitsWarper(0.9), TopKLogitsWarper(20), TopPLogitsWarper(0.5)],
        ),
    ],
)
def test_filters_keep_what_transformers_keeps(params, warpers):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    ours = filtered_probs(logits, [params] * 6)
    theirs = logits.clone()
    for warp in warpers:
        theirs = warp(None, theirs)
    theirs = theirs.softmax(-1)
    assert torch.equal(ours > 0, theirs > 0)
    if params.min_p == 0:  # transformers renormalises after min-p masking; we draw from the masked weights
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.2, top_p=0.6)],
        [SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.05), SamplingParams(temperature=1, top_k=3)],
        [SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=0.5, top_k=2)],  # a long tail
        [SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0.5, top_k=2)],
    ],
)
def test_short_candidate_lists_equal_the_full_vocabulary(params):
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(3)) * 2
    want = filtered_probs(logits, params)
    for row, (weights, ids) in enumerate(candidates(logits, params)):
        full = weights if ids is None else torch.zeros(5000).scatter_(0, ids, weights)
        assert torch.equal(full > 0, want[row] > 0)
        torch.testing.assert_close(full / full.sum(), want[row] / want[row].sum())


def test_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]])
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(torch.device("cpu"))
    seqs = [Sequence(i, [1], params) for i in range(4000)]
    tokens = torch.tensor(sampler.sample(logits.expand(4000, 5).contiguous(), seqs))
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.025, rtol=0)


def test_seeded_rows_do_not_depend_on_batch_or_neighbours(tiny):
    prompts = tiny[3]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i) for i in range(8)]
    alone = engine(tiny, max_num_seqs=2).generate(prompts[:8], params)
    # other rows around them, sampled and greedy, in a bigger batch with a different order
    noise = [SamplingParams(max_tokens=20, temperature=1.2, seed=7)] * 8 + [SamplingParams(max_tokens=5)] * 8
    mixed_prompts = prompts[16:24] + prompts[:8][::-1] + prompts[8:16]
    mixed = engine(tiny, max_num_seqs=24).generate(mixed_prompts, noise[:8] + params[::-1] + noise[8:])
    assert [s.completion for s in alone] == [s.completion for s in mixed[8:16][::-1]]
    greedy = engine(tiny).generate(prompts[:8], SamplingParams(max_tokens=12))
    assert sum(a.completion != g.completion for a, g in zip(alone, greedy, strict=True)) >= 6  # really sampled


def test_unseeded_sampling_is_reproducible_per_sequence_id(tiny):
    prompts, params = tiny[3][:6], SamplingParams(max_tokens=10, temperature=1.0)
    a = engine(tiny, max_num_seqs=3).generate(prompts, params)
    b = engine(tiny, max_num_seqs=6).generate(prompts, params)
    assert [s.completion for s in a] == [s.completion for s in b]
    assert len({tuple(s.completion) for s in a}) == 6


def test_stop_rules(tiny):
    prompt = tiny[3][3]
    base = engine(tiny).generate([prompt], SamplingParams(max_tokens=24))[0]
    assert base.finish_reason == "length" and base.num_completion == 24
    stop_at = next(i for i, t in enumerate(base.completion) if i >= 4 and t not in base.completion[:i])
    token = base.completion[stop_at]
    by_id = engine(tiny).generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(token,)))[0]
    assert by_id.completion == base.completion[: stop_at + 1] and by_id.finish_reason == "stop"
    eng = engine(tiny)
    eng.eos = frozenset({token})
    assert eng.generate([prompt], SamplingParams(max_tokens=24))[0].completion == by_id.completion
    eng = engine(tiny)
    eng.eos = frozenset({token})
    ignored = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert ignored.completion == base.completion and ignored.finish_reason == "length"
    tokenizer = tiny[2]
    text = tokenizer.decode(base.completion)
    word = text.split()[len(text.split()) // 2]
    by_text = engine(tiny).generate([prompt], SamplingParams(max_tokens=24, stop=(word,)))[0]
    kept = tokenizer.decode(by_text.completion)[: by_text.stop_text_cut]
    assert by_text.finish_reason == "stop" and kept == text[: text.find(word)]
    assert by_text.num_completion < 24


def test_invalid_parameters_are_named():
    assert "top_p" in SamplingParams(top_p=0).problem()
    assert "temperature" in SamplingParams(temperature=-1).problem()
    assert "max_tokens" in SamplingParams(max_tokens=0).problem()
    assert "top_k" in SamplingParams(top_k=-2).problem()
    assert SamplingParams(temperature=0.5, top_p=0.3, top_k=3, min_p=0.1).problem() is None


def test_a_long_list_is_drawn_in_two_rounds_with_its_own_distribution():
    """Past 512 candidates the race picks a block of 256, then a token in it: still exact."""
    from hpcinfer.engine.sample.sampling import RACE_BLOCK, draw

    weights = torch.rand(1000, generator=torch.Generator().manual_seed(1)) ** 4  # a flat tail, a few peaks
    assert weights.numel() > 2 * RACE_BLOCK
    gen = torch.Generator().manual_seed(2)
    n = 40_000
    counts = torch.bincount(torch.stack([draw(weights, gen) for _ in range(n)]), minlength=1000).float()
    expected = n * weights / weights.sum()
    groups = torch.argsort(weights).view(10, 100)  # ten groups of a hundred tokens, lightest to heaviest
    torch.testing.assert_close(counts[groups].sum(1) / n, expected[groups].sum(1) / n, atol=0.006, rtol=0)
    assert counts[weights == 0].sum() == 0


def test_greedy_picks_what_argmax_picks_ties_nan_and_all_inf_included():
    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(-2, 3, (64, 3001), generator=gen).float()  # many equal maxima a row
    odd = torch.zeros(3, 10)
    odd[0, 2], odd[0, 5] = float("nan"), 9.0  # a NaN wins, as in argmax
    odd[1] = -torch.inf
    odd[2, 4] = odd[2, 8] = 1.0  # the first of equals
    for logits in (ties, odd, ties.to(torch.bfloat16)):
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert greedy(odd).tolist() == [2, 0, 4]
