"""n samples per prompt: one prefill, KV blocks shared by the samples, each sample its own seed.

The oracle of a sample is the same row run alone with n = 1 and the sample's seed
(`sample_seed(seed, index)`): a sample never depends on its siblings, neighbours or the pool.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sample.sampling import sample_seed
from hpcinfer.engine.sequence import SamplingParams

from ..conftest import generate_config, run_job, tiny_llama, write_jsonl


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, one_torch_thread):  # noqa: ANN201
    return tiny_llama(tmp_path_factory.mktemp("n"), seed=3, prompts=6, max_length=48, text_seed=4, byte_level=True)


PARAMS = [
    SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=4, ignore_eos=True),
    SamplingParams(max_tokens=12, n=3, ignore_eos=True),  # greedy: every sample the same answer
    SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=9, n=1),
    SamplingParams(max_tokens=8, temperature=1.2, top_p=0.9, n=5, ignore_eos=True),  # unseeded
]


def _alone(model, info, prompt: list[int], params: SamplingParams, seq_id: int, index: int) -> list[int]:  # noqa: ANN001
    engine = Engine(model, EngineConfig(max_num_seqs=4, kv_cache_memory=2 << 20, block_size=4), info.eos_token_ids)
    seed = params.seed if params.seed is not None else 1_000_003 * engine.config.seed + seq_id  # the run's rule
    seq = engine.add(prompt, replace(params, n=1, seed=sample_seed(seed, index)), seq_id=seq_id)
    while engine.has_work:
        engine.step()
    return seq.completion


@pytest.mark.parametrize(
    ("ahead", "prefix_cache", "pool"), [(False, True, 2 << 20), (True, False, 2 << 20), (False, True, 40 << 10)]
)
def test_each_sample_is_the_row_alone_with_its_seed(llama, ahead: bool, prefix_cache: bool, pool: int) -> None:
    """Blocks of 4 tokens, so most prompts end in a partly filled block the forks copy; the small
    pool (40 KiB) cannot give every fork its block at once, and those forks queue as prompts."""
    _, info, model, prompts = llama
    prompts = prompts[: len(PARAMS)]
    config = EngineConfig(max_num_seqs=16, kv_cache_memory=pool, block_size=4, ahead=ahead, prefix_cache=prefix_cache)
    engine = Engine(model, config, info.eos_token_ids)
    seqs = [engine.add(p, params, seq_id=i) for i, (p, params) in enumerate(zip(prompts, PARAMS, strict=True))]
    finished = []
    while engine.has_work:
        finished += engine.step()
    assert sorted(id(s) for s in finished) == sorted(id(s) for s in seqs)  # one finish per request
    if pool > 1 << 20:
        assert engine.stats.prefill_tokens == sum(map(len, prompts))  # each prompt prefilled once
    for i, (prompt, params, seq) in enumerate(zip(prompts, PARAMS, seqs, strict=True)):
        samples = seq.all_samples
        assert [s.sample_index for s in samples] == list(range(params.n))
        for index, sample in enumerate(samples):
            assert sample.completion == _alone(model, info, prompt, params, i, index), (i, index)
    greedy = [s.completion for s in seqs[1].all_samples]
    assert greedy[0] == greedy[1] == greedy[2]
    drawn = [tuple(s.completion) for s in seqs[0].all_samples]
    assert len(set(drawn)) > 1  # seeded samples differ from each other


def test_forks_of_prompts_still_prefilling_hold_their_places(llama) -> None:
    """More samples than --max-num-seqs: prompts admitted together, each with forks still to come,
    never put more sequences in a step than the engine's buffers hold."""
    _, info, model, prompts = llama
    config = EngineConfig(max_num_seqs=4, kv_cache_memory=2 << 20, block_size=4, max_num_batched_tokens=512)
    engine = Engine(model, config, info.eos_token_ids)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2, n=2, ignore_eos=True)
    seqs = [engine.add(p, params, seq_id=i) for i, p in enumerate(prompts)]
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most <= 4
    assert all(len(s.all_samples) == 2 and all(len(x.completion) == 6 for x in s.all_samples) for s in seqs)


def test_openai_bodies_answer_n_choices(llama, tmp_path: Path) -> None:
    path, *_ = llama
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "temperature": 1.0, "seed": 3}
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "n": 3}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "once upon a time", "max_tokens": 5, "n": 2, "temperature": 0.9, "logprobs": 2}},
        {"custom_id": "zero", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}},
        {"custom_id": "many", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 20}},
        {"custom_id": "word", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": "two"}},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "batch.jsonl", lines)
    report, _ = run_job(generate_config(src, tmp_path / "out.jsonl", path, max_num_seqs=16))
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    answers = {a["custom_id"]: a for a in map(json.loads, lines)}  # NOTE: not via Arrow, which unites the keys
    completion = ChatCompletion.model_validate(answers["chat"]["response"]["body"])
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.usage is not None and completion.usage.completion_tokens == 18  # 3 x max_tokens
    text = Completion.model_validate(answers["text"]["response"]["body"])
    assert len(text.choices) == 2 and all(
        c.logprobs and len(c.logprobs.token_logprobs or []) == 5 for c in text.choices
    )
    assert report.completion_tokens == 18 + 10 and sum(report.finish_reasons.values()) == 5
    rejects = {
        r["id"]: (r["reason"], r["message"])
        for r in map(json.loads, Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text().splitlines())
    }
    assert rejects["zero"][0] == "invalid_sampling" and "n must be in" in rejects["zero"][1]
    assert rejects["many"][0] == "invalid_sampling" and "max-num-seqs" in rejects["many"][1]
    assert rejects["word"][0] == "invalid_request"
    # a rejected request is an output line too, in the batch API's error format; rows count answers
    assert len(lines) == 5 and report.rows == 2
    assert answers["zero"]["response"] is None and answers["zero"]["error"]["code"] == "invalid_sampling"
    assert [a["custom_id"] for a in map(json.loads, lines)] == ["chat", "text", "zero", "many", "word"]


def test_plain_rows_with_n_are_lists(llama, tmp_path: Path) -> None:
    path, *_ = llama
    rows = [{"id": "a", "prompt": "hello", "temperature": 1.0}, {"id": "b", "prompt": "world", "n": 4}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    _, table = run_job(generate_config(src, tmp_path / "out.parquet", path, max_tokens=5, n=2, ignore_eos=True))
    out = table.to_pylist()
    assert [len(r["text"]) for r in out] == [2, 4] and [len(r["finish_reason"]) for r in out] == [2, 4]
    assert [r["completion_tokens"] for r in out] == [10, 20]
    assert len(set(out[1]["text"])) == 1  # greedy: four times the same answer
    # without --n, a plain row asking for n > 1 is a reject; the others are answered as before
    _, table = run_job(generate_config(src, tmp_path / "one.jsonl", path, max_tokens=5))
    assert table.column("id").to_pylist() == ["a"] and isinstance(table.column("text")[0].as_py(), str)
    reject = json.loads(Path(f"{tmp_path / 'one.jsonl'}.rejects.jsonl").read_text())
    assert reject["reason"] == "invalid_request" and "--n" in reject["message"]


def test_n_with_structured_output(tmp_path: Path, one_torch_thread) -> None:
    """Every fork holds a matcher of its own."""
    from tests.fixtures.tiny_gguf import build_tiny_gguf

    model = build_tiny_gguf(tmp_path / "tiny.gguf", seed=4)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "pick", "choice": ["alpha", "beta", "gamma"]}])
    _, table = run_job(generate_config(src, tmp_path / "out.jsonl", model, n=6, temperature=1.5, seed=1))
    texts = table.column("text")[0].as_py()
    assert len(texts) == 6 and set(texts) <= {"alpha", "beta", "gamma"} and len(set(texts)) > 1


def test_the_pool_engine_counts_a_request_once(llama) -> None:
    """`generate` returns one sequence per prompt; its samples hang from it."""
    _, info, model, prompts = llama
    engine = Engine(model, EngineConfig(max_num_seqs=8, kv_cache_memory=2 << 20), info.eos_token_ids)
    seqs = engine.generate(prompts[:2], SamplingParams(max_tokens=4, n=4, temperature=1.0, seed=2))
    assert [len(s.all_samples) for s in seqs] == [4, 4]
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add(prompts[0], SamplingParams(n=9))
    assert torch.get_num_threads() == 1
