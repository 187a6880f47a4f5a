"""Exactness: continuous batching over the paged cache gives transformers' greedy tokens.

The oracle is `transformers` `generate` in float32 (tests/fixtures/tiny_decoder.py's
`transformers_greedy`: one batch, each answer confirmed by an unbatched forward, near ties generated
one prompt at a time). Random checkpoints use an initializer_range of 0.1 so greedy outputs vary (at
0.02 they repeat one token and prove nothing).
"""

from __future__ import annotations

import pytest
import torch

from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.kvcache.pools import KVLayout
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.registry import load_tokenizer
from tests.fixtures.tiny_decoder import build_tiny_decoder, transformers_greedy

from ..conftest import make_texts

MAX_TOKENS = 32
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory, one_torch_thread):
    """(model, info, prompts, reference completions, reference model) for one architecture."""
    arch = request.param
    path = build_tiny_decoder(tmp_path_factory.mktemp(arch), arch, seed=11 + ARCHS.index(arch))
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(path, 256)
    prompts = [tokenizer.encode(t).ids for t in make_texts(64, seed=5)]
    ref, expected = transformers_greedy(path, arch, prompts, MAX_TOKENS, info.eos_token_ids)
    return model, info, prompts, expected, ref


def margin(ref, tokens: list[int]) -> float:
    """The reference's top-1 minus top-2 logit after `tokens`: how near a tie the divergence was."""
    with torch.inference_mode():
        top = ref(torch.tensor([tokens])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def check(case, config: EngineConfig) -> Engine:
    model, info, prompts, expected, ref = case
    engine = Engine(model, config, info.eos_token_ids)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    same = 0
    for prompt, seq, want in zip(prompts, seqs, expected, strict=True):
        got = seq.completion
        if got == want:
            same += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        print(f"diverged at token {at}: logit margin {margin(ref, prompt + want[:at]):.2e}")
    print(
        f"{info.config.architecture}: {same}/64 equal, {engine.stats.steps} steps, "
        f"{engine.stats.preemptions} preemptions, peak {engine.stats.peak_blocks}/{engine.blocks.num_blocks} blocks"
    )
    assert same >= 63
    assert sum(len(s.completion) for s in seqs) > 64 * 8  # mostly long answers, not instant EOS
    assert len({tuple(s.completion[:8]) for s in seqs}) > 32  # varied, not one repeated token
    return engine


def test_greedy_equals_transformers(case):
    engine = check(case, EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, kv_cache_memory=64 << 20))
    assert engine.stats.preemptions == 0 and engine.blocks.num_used == 0


def test_chunked_prefill_keeps_tokens(case):
    engine = check(case, EngineConfig(max_num_seqs=16, max_num_batched_tokens=24, kv_cache_memory=64 << 20))
    assert engine.stats.continued_chunks > 10  # prompts really spanned several steps


def test_preemption_keeps_tokens(case):
    model = case[0]
    block = KVLayout.of(model.cfg, 16, torch.float32).bytes_per_block
    engine = check(case, EngineConfig(max_num_seqs=64, max_num_batched_tokens=256, kv_cache_memory=24 * block))
    assert engine.blocks.num_blocks == 24 and engine.stats.preemptions > 0
    assert engine.blocks.num_used == 0


def test_small_decode_groups_keep_tokens(case, monkeypatch):
    """On CPU decodes are grouped so each group's gathered K/V stay in cache; tiny groups of a few
    rows (and so many attention calls per layer, each padded to its own width) change no token."""
    from hpcinfer.engine import runner

    block = KVLayout.of(case[0].cfg, 16, torch.float32).bytes_per_block // case[0].cfg.num_layers
    monkeypatch.setattr(runner, "decode_group_bytes", lambda: 8 * block)
    sizes: list[int] = []
    bounds = runner.ModelRunner._group_bounds

    def recording(self, nd):
        got = bounds(self, nd)
        sizes.extend(end - start for start, end in got)
        return got

    monkeypatch.setattr(runner.ModelRunner, "_group_bounds", recording)
    check(case, EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, kv_cache_memory=64 << 20))
    assert max(sizes) <= 8 and sizes.count(1) > 0 and len(sizes) > 200
