"""Beam search (--beam-width, a row's beam_width or vLLM's use_beam_search): each answer equal to
transformers' generate(num_beams=...) on 16 prompts (token ids in), at several widths and length
penalties; the beams share the prompt's KV blocks; rows and OpenAI bodies pick it, bad combinations
are rejects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.kvcache.block_manager import blocks_for
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.tasks.generate.job import run_generate

from ..conftest import generate_config, tiny_llama, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("beam"), seed=9, prompts=16, max_length=48, text_seed=3, byte_level=True)


def hf_beams(ref, prompt: list[int], width: int, max_tokens: int, penalty: float, eos: set[int]) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, num_beams=width, do_sample=False,
                           length_penalty=penalty)[0, len(prompt) :].tolist()  # fmt: skip
    cut = next((i for i, t in enumerate(out) if t in eos), None)
    return out[: cut + 1] if cut is not None else out  # NOTE: transformers pads a finished beam after its EOS


@pytest.mark.parametrize(("width", "penalty"), [(2, 1.0), (4, 1.0), (3, 0.5), (4, 2.0)])
def test_beams_equal_transformers_num_beams(tiny, width, penalty):
    path, info, model, prompts = tiny
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(model, EngineConfig(), info.eos_token_ids)
    params = SamplingParams(max_tokens=12, beam_width=width, length_penalty=penalty)
    got = [s.completion for s in engine.generate(prompts, params)]
    eos = set(info.eos_token_ids)
    expected = [hf_beams(ref, p, width, 12, penalty, eos) for p in prompts]
    assert got == expected
    greedy = [s.completion for s in Engine(model, EngineConfig(), info.eos_token_ids).generate(
        prompts, SamplingParams(max_tokens=12))]  # fmt: skip
    assert got != greedy  # the beams found other answers than greedy's


def test_beams_share_the_prompts_blocks(tiny):
    _, info, model, prompts = tiny
    prompt = (prompts[0] * 30)[:70]  # NOTE: 4 full blocks of 16, shared by every beam
    assert len(prompt) == 70
    engine = Engine(model, EngineConfig(block_size=16), info.eos_token_ids)
    engine.generate([prompt], SamplingParams(max_tokens=8, beam_width=4))
    apart = 4 * blocks_for(len(prompt) + 8, 16)  # each beam with its own copy of the prompt: 20
    # NOTE: shared, the 4 full prompt blocks, and each beam's own last block or two, plus one per beam while it forks
    assert engine.blocks.peak_used <= 4 + 4 * 3 < apart
    assert engine.blocks.num_used == 0  # every beam's blocks back (cached ones stay findable)


def test_rows_and_openai_bodies_pick_beam_search(tiny, tmp_path):
    path, info, model, prompts = tiny
    rows = [
        {"id": "width", "prompt_token_ids": prompts[0], "max_tokens": 10, "beam_width": 3},
        {"id": "vllm", "prompt_token_ids": prompts[1], "max_tokens": 10, "use_beam_search": True, "best_of": 3},
        {"id": "plain", "prompt_token_ids": prompts[2], "max_tokens": 10},
        {"id": "sampled", "prompt_token_ids": prompts[3], "beam_width": 3, "temperature": 0.8},
        {"id": "wide", "prompt_token_ids": prompts[3], "beam_width": 99},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_generate(generate_config(src, tmp_path / "out.jsonl", path))
    assert report.rejects == {"invalid_sampling": 2}
    got = {a["id"]: a for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    engine = Engine(model, EngineConfig(), info.eos_token_ids)
    want = [s for s in engine.generate(prompts[:2], SamplingParams(max_tokens=10, beam_width=3))]
    from hpcinfer.models.decoder_checkpoint import load_tokenizer

    tokenizer = load_tokenizer(info)
    for key, seq in zip(("width", "vllm"), want, strict=True):
        ids = seq.completion[:-1] if seq.stop_token else seq.completion
        assert got[key]["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert got[key]["completion_tokens"] == len(seq.completion)
    rejects = Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text()
    assert "beam_width" in rejects
