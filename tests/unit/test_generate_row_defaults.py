"""The run's sampling options are the rows' defaults by name: each reaches a row that sets none of
its own, and each is in the resume fingerprint, so a resumed run never mixes two settings."""

from __future__ import annotations

from dataclasses import replace

import torch

from hpcinfer.config import GenerateConfig, InputConfig, RunConfig
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.tasks.generate.setup import ROW_DEFAULTS, generation_fingerprint, sampling_defaults
from tests.fixtures.tiny_decoder import build_tiny_decoder

CHANGED = {  # a valid value other than the default, per option
    "max_tokens": 17,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "stop": ("END",),
    "ignore_eos": True,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "min_tokens": 2,
    "n": 2,
    "beam_width": 3,
    "length_penalty": 0.5,
}


def test_every_row_default_reaches_the_rows_and_the_fingerprint(tmp_path):
    assert set(ROW_DEFAULTS) == set(CHANGED)  # a new shared option needs a value here
    info = inspect_decoder(build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=0))
    base = RunConfig(input=InputConfig(("in.jsonl",)), model=str(info.path))
    before = generation_fingerprint(base, info, [], torch.float32)
    for name, value in CHANGED.items():
        config = replace(base, generate=replace(GenerateConfig(), **{name: value}))
        assert getattr(sampling_defaults(config), name) == value, name
        assert generation_fingerprint(config, info, [], torch.float32) != before, name
