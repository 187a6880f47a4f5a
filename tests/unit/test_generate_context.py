"""--max-model-len: a context shorter than the checkpoint's for positions, the KV pool and prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcinfer.config import RunConfig
from hpcinfer.errors import ConfigError
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import generate_config, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(tmp_path, model, rows, **gen) -> RunConfig:
    return generate_config(
        write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", model, ignore_eos=True, **gen
    )


def test_max_model_len_caps_prompts_and_answers(tmp_path):
    model = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=1, max_positions=512)
    rows = [
        {"id": "fits", "prompt_token_ids": list(range(1000, 1030)), "max_tokens": 100},
        {"id": "long", "prompt_token_ids": list(range(1000, 1050))},
    ]
    report = run_generate(config(tmp_path, model, rows, max_model_len=40, max_tokens=100))
    (answer,) = map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    assert answer["id"] == "fits" and answer["finish_reason"] == "length"
    assert answer["prompt_tokens"] + answer["completion_tokens"] == 40  # the context ends the answer
    (reject,) = map(json.loads, Path(f"{tmp_path / 'out.jsonl'}.rejects.jsonl").read_text().splitlines())
    assert reject["reason"] == "too_long" and "prompt of 50 tokens; the context holds 39" in reject["message"]
    assert report.rows == 1


def test_a_cap_past_the_checkpoints_context_is_refused(tmp_path):
    model = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=1, max_positions=64)
    with pytest.raises(ConfigError, match=r"--max-model-len 65: the checkpoint's context is 64 tokens"):
        run_generate(config(tmp_path, model, [{"id": 1, "prompt": "hi"}], max_model_len=65))
