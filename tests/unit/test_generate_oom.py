"""A step that runs out of device memory is split, not a fault: the same answers, a smaller budget."""

from __future__ import annotations

import pytest
import torch

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sequence import SamplingParams

from ..conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, info, model, prompts = tiny_llama(
        tmp_path_factory.mktemp("oom"), seed=5, prompts=24, max_length=96, text_seed=2, byte_level=True
    )
    params = [SamplingParams(max_tokens=12, temperature=0.9 if i % 2 else 0.0, seed=i) for i in range(len(prompts))]
    return model, info, prompts, params


def with_memory_limit(engine: Engine, tokens: int) -> list[int]:
    """Makes every step over `tokens` tokens fail as a GPU out of memory would; returns the step sizes tried."""
    run, tried = engine.runner.run, []

    def limited(plan, *args):
        size = sum(c.length for c in plan.chunks)
        tried.append(size)
        if size > tokens:
            raise torch.OutOfMemoryError(f"CUDA out of memory (a step of {size} tokens)")
        return run(plan, *args)

    engine.runner.run = limited
    return tried


def test_an_out_of_memory_step_is_split_and_the_answers_do_not_change(tiny):
    model, info, prompts, params = tiny
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory=16 << 20)
    expected = [s.completion for s in Engine(model, config, info.eos_token_ids).generate(prompts, params)]
    engine = Engine(model, config, info.eos_token_ids)
    tried = with_memory_limit(engine, 60)
    got = [s.completion for s in engine.generate(prompts, params)]
    assert got == expected  # greedy and seeded rows alike
    assert engine.stats.oom_splits >= 2 and max(tried) > 60
    assert engine.scheduler.max_num_batched_tokens <= 64  # halved until the steps fit
    assert engine.stats.preemptions > 0 and engine.blocks.num_used == 0


def test_a_step_that_cannot_be_split_further_raises(tiny):
    model, info, prompts, params = tiny
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), info.eos_token_ids)
    with_memory_limit(engine, 0)  # not even one token fits
    with pytest.raises(torch.OutOfMemoryError):
        engine.generate(prompts[:3], params[:3])
    assert engine.scheduler.max_num_batched_tokens == engine.config.block_size
    assert engine.scheduler.max_num_seqs == 1
