"""Log-probabilities in OpenAI batch answers: the model's own values (against transformers), in the
shapes the `openai` package's types accept; asked outside an OpenAI body, a reject."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from openai.types import Completion
from openai.types.chat import ChatCompletion

from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import generate_config, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_logprobs_in_openai_shapes_equal_transformers(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=4)
    chat = {
        "messages": [{"role": "user", "content": "the quick fox"}],
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 3,
    }
    rows = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "a batch of tokens", "max_tokens": 5, "logprobs": 2}},
        {"custom_id": "penalized", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "a batch of tokens", "max_tokens": 5, "logprobs": 0, "repetition_penalty": 1.5}},
        {"custom_id": "none", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}},
    ]  # fmt: skip
    out = tmp_path / "out.jsonl"
    run_generate(generate_config(write_jsonl(tmp_path / "in.jsonl", rows), out, path, ignore_eos=True))
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    chat_answer = ChatCompletion.model_validate(bodies["chat"])  # the openai package's own types
    text_answer = Completion.model_validate(bodies["text"])
    assert Completion.model_validate(bodies["none"]).choices[0].logprobs is None

    content = chat_answer.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the best is chosen
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)
    text_lp = text_answer.choices[0].logprobs
    assert len(text_lp.tokens) == len(text_lp.token_logprobs) == 5 and all(len(t) == 2 for t in text_lp.top_logprobs)
    assert text_lp.text_offset[0] == 0 and "".join(text_lp.tokens) == text_answer.choices[0].text

    penalized = Completion.model_validate(bodies["penalized"]).choices[0].logprobs
    assert penalized.top_logprobs is None and len(penalized.token_logprobs) == 5

    # the values are the model's own: transformers' greedy answer and its raw logits, step by step
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()  # as the engine's reader takes it
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.tensor([tokenizer.encode("a batch of tokens").ids])
    with torch.no_grad():
        out = ref.generate(prompt, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    answer = out.sequences[0, prompt.shape[1] :].tolist()
    expected = [float(torch.log_softmax(logits[0], -1)[t]) for logits, t in zip(out.logits, answer, strict=True)]
    assert tokenizer.decode(answer) == text_answer.choices[0].text
    for value, want in zip(text_lp.token_logprobs, expected, strict=True):
        assert math.isclose(value, want, abs_tol=1e-4)
    assert [dict(top) for top in text_lp.top_logprobs][0][text_lp.tokens[0].strip()] == pytest.approx(
        expected[0], abs=1e-4
    )


def test_logprobs_outside_an_openai_body_are_a_reject(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=4)
    rows = [{"id": "a", "prompt": "hi", "logprobs": 2}, {"id": "b", "prompt": "hi"}]
    out = tmp_path / "out.jsonl"
    run_generate(generate_config(write_jsonl(tmp_path / "in.jsonl", rows), out, path, max_tokens=2))
    (reject,) = map(json.loads, Path(f"{out}.rejects.jsonl").read_text().splitlines())
    assert reject["id"] == "a" and "OpenAI batch" in reject["message"]


def test_prompt_logprobs_equal_a_teacher_forced_transformers_forward(tmp_path):
    """vLLM's `prompt_logprobs`: every prompt token after the first, from the same forward, with
    prompts cut into chunks (a small step budget) and one prompt twice (no prefix cache hit)."""
    path = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=6)
    text = "the quick brown fox jumps over the lazy dog and keeps on running far away"
    body = {"prompt": text, "max_tokens": 2, "prompt_logprobs": 3}
    rows = [
        {"custom_id": "first", "method": "POST", "url": "/v1/completions", "body": body},
        {"custom_id": "again", "method": "POST", "url": "/v1/completions", "body": {**body, "n": 2}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "prompt_logprobs": 0}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "prompt_logprobs": 99}},
    ]  # fmt: skip
    out = tmp_path / "out.jsonl"
    config = generate_config(write_jsonl(tmp_path / "in.jsonl", rows), out, path, max_num_batched_tokens=7)
    run_generate(config)
    answers = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert answers["bad"]["error"]["code"] == "invalid_sampling"
    first = Completion.model_validate(answers["first"]["response"]["body"])
    prompt_lp = first.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    again = answers["again"]["response"]["body"]["choices"]
    assert again[0]["prompt_logprobs"] == again[1]["prompt_logprobs"]  # the request's, on each choice
    for mine, theirs in zip(again[0]["prompt_logprobs"][1:], prompt_lp[1:], strict=True):
        assert mine.keys() == theirs.keys()  # NOTE: values to rounding: its chunks fall elsewhere in steps
        assert all(math.isclose(mine[t]["logprob"], theirs[t]["logprob"], abs_tol=1e-4) for t in mine)
    chat = ChatCompletion.model_validate(answers["chat"]["response"]["body"])
    chat_lp = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat_lp[0] is None and all(len(entry) == 1 for entry in chat_lp[1:])  # K = 0: the token alone

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()
    ids = tokenizer.encode(text).ids
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert prompt_lp[0] is None and len(prompt_lp) == len(ids) > 7  # more than one chunk
    for position in range(1, len(ids)):
        entry = prompt_lp[position]
        want = logp[position - 1]
        token = ids[position]
        assert math.isclose(entry[str(token)]["logprob"], float(want[token]), abs_tol=1e-4)
        # NOTE: the rank among logprobs equal to ours within the same 1e-4: a random model's
        # middle ranks sit thousands deep in a near-flat distribution, where rounding reorders ties
        above = int((want > want[token] + 1e-4).sum()) + 1
        assert above <= entry[str(token)]["rank"] <= int((want > want[token] - 1e-4).sum()) + 1
        assert entry[str(token)]["rank"] - above <= 8  # a handful of near-ties, not a wrong rank
        best = want.topk(3).indices.tolist()
        assert set(entry) == {str(t) for t in best} | {str(token)}
        for t in best:
            assert math.isclose(entry[str(t)]["logprob"], float(want[t]), abs_tol=1e-4)
