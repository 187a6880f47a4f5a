"""Penalties, logit bias, min_tokens, allowed_token_ids and bad_words: transformers' repetition
penalty, OpenAI's presence and frequency penalties, vLLM's token rules (property tests), the same
answers a step ahead, bad values and fields not honoured as rejects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sample.penalties import penalize
from hpcinfer.engine.sequence import SamplingParams, Sequence
from hpcinfer.tasks.generate.job import run_generate

from ..conftest import generate_config, tiny_llama, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("pen"), seed=9, prompts=16, max_length=48, text_seed=3)


def test_repetition_penalty_equals_transformers_greedy(tiny):
    path, info, model, prompts = tiny
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=16, repetition_penalty=1.8)
    got = [s.completion for s in Engine(model, EngineConfig(), info.eos_token_ids).generate(prompts, params)]
    same = 0
    for prompt, answer in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8)
        expected = out[0, len(prompt) :].tolist()
        eos = [i for i, t in enumerate(expected) if t in info.eos_token_ids]
        same += answer == (expected[: eos[0] + 1] if eos else expected)
    print(f"repetition_penalty 1.8: {same}/16 greedy answers equal transformers'")
    assert same >= 15, f"{same}/16 equal"
    plain = [
        s.completion
        for s in Engine(model, EngineConfig(), info.eos_token_ids).generate(prompts, SamplingParams(max_tokens=16))
    ]
    assert plain != got  # the penalty changed answers


def test_presence_frequency_and_bias_follow_openais_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    seqs = [
        Sequence(
            0,
            [1, 2, 3, 3, 5, 5, 5],
            SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((9, 2.0),)),
        ),
        Sequence(1, [4, 4], SamplingParams()),
    ]
    seqs[0].num_prompt = 3  # prompt 1, 2, 3; answer 3, 5, 5, 5
    seqs[1].num_prompt = 1
    expected = logits.clone()
    counts = {3: 1, 5: 3}
    for token, n in counts.items():
        expected[0, token] -= 0.25 * n + 0.5
    expected[0, 9] += 2.0
    got = penalize(logits.clone(), seqs, eos=())
    assert torch.allclose(got, expected)


def test_logit_bias_and_min_tokens_steer_answers(tiny):
    _, info, model, prompts = tiny
    eos = min(info.eos_token_ids)
    forced = SamplingParams(max_tokens=8, logit_bias=((7, 100.0),))
    late_eos = SamplingParams(max_tokens=12, logit_bias=((eos, 100.0),), min_tokens=5)
    engine = Engine(model, EngineConfig(), info.eos_token_ids)
    a, b = engine.generate(prompts[:2], [forced, late_eos])
    assert a.completion == [7] * 8
    assert b.completion == [*b.completion[:5], eos] and eos not in b.completion[:5] and b.finish_reason == "stop"


def test_a_step_ahead_gives_the_same_penalized_answers(tiny):
    _, info, model, prompts = tiny
    params = [
        SamplingParams(max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4, min_tokens=3,
                       temperature=0.8 if i % 2 else 0.0, seed=i)
        for i in range(len(prompts))
    ]  # fmt: skip
    runs = []
    for ahead in (False, True):
        engine = Engine(model, EngineConfig(ahead=ahead, max_num_seqs=6), info.eos_token_ids)
        runs.append([s.completion for s in engine.generate(prompts, params)])
    assert runs[0] == runs[1]
    assert all(len(answer) >= 3 for answer in runs[0])  # min_tokens held


def test_rows_set_penalties_and_bad_values_are_rejects(tiny, tmp_path):
    path, info, _, _ = tiny
    rows = [
        {"id": "ok", "prompt": "the fox", "presence_penalty": 1.0, "logit_bias": {"7": 5}, "min_tokens": 2},
        {"id": "big", "prompt": "the fox", "presence_penalty": 3},
        {"id": "vocab", "prompt": "the fox", "logit_bias": {str(info.config.vocab_size): 1}},
        {"id": "shape", "prompt": "the fox", "logit_bias": [1, 2]},
        {"id": "min", "prompt": "the fox", "min_tokens": 9, "max_tokens": 4},
    ]
    out = tmp_path / "out.jsonl"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_generate(generate_config(src, out, path, max_tokens=4, repetition_penalty=1.2))
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["ok"]
    rejects = {r["id"]: r for r in map(json.loads, Path(f"{out}.rejects.jsonl").read_text().splitlines())}
    assert rejects["big"]["reason"] == "invalid_sampling" and "presence_penalty" in rejects["big"]["message"]
    assert rejects["vocab"]["reason"] == "invalid_request" and "outside the vocabulary" in rejects["vocab"]["message"]
    assert rejects["shape"]["reason"] == "invalid_request"
    assert rejects["min"]["reason"] == "invalid_sampling"
    assert report.rows == 1


class _OnlyThese(transformers.LogitsProcessor):
    """transformers' side of allowed_token_ids: every other token's score -inf."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        barred = torch.full_like(scores, -torch.inf)
        barred[:, self.allowed] = 0.0
        return scores + barred


def test_allowed_token_ids_equal_transformers_with_a_masking_processor(tiny):
    """vLLM's allowed_token_ids: greedy answers hold only the listed tokens, equal to transformers'
    generate with every other token masked; sampled answers hold only them too."""
    path, info, model, prompts = tiny
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    allowed = sorted({t for p in prompts for t in p[:3]} | {5, 7})  # NOTE: no EOS: answers run to max_tokens
    params = SamplingParams(max_tokens=12, allowed_token_ids=tuple(allowed))
    engine = Engine(model, EngineConfig(), info.eos_token_ids)
    got = [s.completion for s in engine.generate(prompts, params)]
    for prompt, answer in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               logits_processor=transformers.LogitsProcessorList([_OnlyThese(allowed)]))  # fmt: skip
        assert answer == out[0, len(prompt) :].tolist()
        assert set(answer) <= set(allowed) and len(answer) == 12
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=(5, 7))
    assert all(set(s.completion) <= {5, 7} for s in engine.generate(prompts, sampled))


def test_allowed_token_ids_from_rows_and_bad_ones_as_rejects(tiny, tmp_path):
    path, info, _, prompts = tiny
    rows = [
        {"id": "ok", "prompt_token_ids": prompts[0], "max_tokens": 6, "allowed_token_ids": [5, 7]},
        {"id": "empty", "prompt_token_ids": prompts[1], "allowed_token_ids": []},
        {"id": "outside", "prompt_token_ids": prompts[2], "allowed_token_ids": [5, 10**9]},
        {"id": "text", "prompt_token_ids": prompts[3], "allowed_token_ids": "5"},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_generate(generate_config(src, tmp_path / "out.jsonl", path))
    answers = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == ["ok"] and report.rejects == {"invalid_request": 3}
    rejects = Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text()
    assert "allowed_token_ids must be a non-empty list" in rejects and "in the vocabulary" in rejects


def _contains(answer: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(answer[i : i + len(word)]) == word for i in range(len(answer) - len(word) + 1))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_words_never_end_an_answer(tiny, data):
    """vLLM's bad_words on token ids, over random word sets drawn from what the model would answer
    (so every ban bites) and random tokens: no answer holds a banned sequence, greedy or sampled,
    with or without a step ahead (the last token then compared on the device)."""
    _, info, model, prompts = tiny
    prompts = prompts[:6]
    free = [s.completion for s in Engine(model, EngineConfig(), info.eos_token_ids).generate(
        prompts, SamplingParams(max_tokens=12))]  # fmt: skip
    grams = sorted({tuple(a[i : i + n]) for a in free for n in (1, 2, 3) for i in range(len(a) - n + 1)})
    words = data.draw(st.lists(st.sampled_from(grams), min_size=1, max_size=6, unique=True))
    words += data.draw(st.lists(st.tuples(*[st.integers(4, 200)] * 2), max_size=3))
    temperature = data.draw(st.sampled_from([0.0, 1.0]))
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5, bad_words=tuple(words))
    runs = []
    for ahead in (False, True):
        engine = Engine(model, EngineConfig(ahead=ahead, max_num_seqs=4), info.eos_token_ids)
        runs.append([s.completion for s in engine.generate(prompts, params)])
    assert runs[0] == runs[1]
    for answer in runs[0]:
        assert not any(_contains(answer, w) for w in words), (answer, words)
    if temperature == 0:
        assert runs[0] != free  # the bans changed greedy answers


def test_bad_words_from_rows_and_fields_not_honoured_are_rejects(tiny, tmp_path):
    path, info, _, prompts = tiny
    free = run_generate(generate_config(write_jsonl(tmp_path / "free.jsonl", [
        {"id": "a", "prompt": "the fox jumps", "max_tokens": 12}]), tmp_path / "free_out.jsonl", path))  # fmt: skip
    assert free.rows == 1
    said = json.loads((tmp_path / "free_out.jsonl").read_text())["text"].split()
    banned = said[:2]  # NOTE: words the model says unbanned
    rows = [
        {"id": "bad", "prompt": "the fox jumps", "max_tokens": 12, "bad_words": banned},
        {"id": "defaults", "prompt": "the fox", "max_tokens": 2, "use_beam_search": False, "skip_special_tokens": True,
         "user": "u1", "stream": False, "n": 1, "best_of": 1},
        {"id": "beam", "prompt": "the fox", "early_stopping": True},
        {"id": "echo", "prompt": "the fox", "echo": True},
        {"id": "special", "prompt": "the fox", "skip_special_tokens": False},
        {"id": "tools", "prompt": "the fox", "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"id": "best", "prompt": "the fox", "best_of": 3},
        {"id": "typical", "prompt": "the fox", "typical_p": 0.5},
        {"id": "badlist", "prompt": "the fox", "bad_words": [""]},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_generate(generate_config(src, tmp_path / "out.jsonl", path))
    answers = {a["id"]: a for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert sorted(answers) == ["bad", "defaults"] and report.rejects == {"invalid_request": 7}
    assert not set(banned) & set(answers["bad"]["text"].split())
    rejects = {
        r["id"]: r["message"]
        for r in map(json.loads, Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text().splitlines())
    }
    for name in ("early_stopping", "echo", "skip_special_tokens", "tools", "best_of", "typical_p", "bad_words"):
        assert any(m.startswith(name) for m in rejects.values()), (name, rejects)
