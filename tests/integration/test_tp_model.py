"""Tensor parallelism on 2 gloo ranks: each rank's shard of Llama, Qwen2 (qkv bias), Qwen3 (q/k
norm), Phi-3 (fused q/k/v and gate/up, partial rotary), Gemma 2 and Gemma 3 tiny checkpoints gives
the logits and greedy tokens of the whole model (TP=1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcinfer.errors import ConfigError
from hpcinfer.models.attention import DenseCausalAttention
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.parallel.decoder import rank_config, vocab_rows
from hpcinfer.parallel.group import free_port
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import REPO

CHECKPOINTS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-bias-tied": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True, "tie": True}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),  # q/k/v and gate/up stored fused
    "gemma3": (  # sandwich norms, (1 + weight), a sliding-window layer (prompts of 19 cross its 8)
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gemma2": (  # soft-capped scores and logits
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0},
    ),
}


def _reference(path: Path, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    model = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    logits, tokens = [], []
    with torch.inference_mode():
        for prompt in prompts:
            seq = list(prompt)
            for step in range(steps):
                hidden = model(torch.tensor(seq), torch.arange(len(seq)), DenseCausalAttention.of(model.cfg))
                rows = model.logits(hidden if step == 0 else hidden[-1:])
                if step == 0:
                    logits.append(rows)
                seq.append(int(rows[-1].argmax()))
            tokens.append(seq[len(prompt) :])
    return logits, tokens


def test_two_gloo_ranks_equal_the_whole_model(tmp_path):
    paths = []
    for name, (arch, extra) in CHECKPOINTS.items():
        paths.append(build_tiny_decoder(tmp_path / name, arch, seed=3, **extra))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 30000, (n,), generator=g).tolist() for n in (1, 7, 19)]
    out, arguments = tmp_path / "tp.pt", tmp_path / "ranks.json"
    ranks = {"world": 2, "port": free_port(), "ckpts": [str(p) for p in paths], "prompts": prompts, "steps": 6}
    arguments.write_text(json.dumps({**ranks, "out": str(out)}), encoding="utf-8")
    started = [
        subprocess.Popen([sys.executable, "-m", "tests.integration.tp_ranks", str(arguments), str(rank)],
                         cwd=REPO, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]  # fmt: skip
    for rank, process in enumerate(started):
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, f"rank {rank}: {stderr[-2000:]}"
    results = torch.load(out)
    for path in paths:
        want_logits, want_tokens = _reference(path, prompts, 6)
        for vocab_parallel in (True, False):
            logits, tokens, weight_bytes = results[(str(path), vocab_parallel)]
            for got, want in zip(logits, want_logits, strict=True):
                assert got.shape == want.shape
                assert (got - want).abs().max().item() <= 1e-4, (path.name, vocab_parallel)
            assert tokens == want_tokens, (path.name, vocab_parallel)
        # the vocabulary-parallel rank holds half the embedding (and head) the replicated one does
        assert results[(str(path), True)][2] < results[(str(path), False)][2]


def test_shard_arithmetic_and_what_does_not_divide(tmp_path):
    assert [vocab_rows(10, r, 4) for r in range(4)] == [(0, 3, 3), (3, 3, 3), (6, 3, 3), (9, 1, 3)]
    cfg = inspect_decoder(build_tiny_decoder(tmp_path / "m", heads=4, kv_heads=2)).config
    half = rank_config(cfg, 2)
    assert (half.num_heads, half.num_kv_heads, half.intermediate_size, half.vocab_size) == (2, 1, 64, cfg.vocab_size)
    with pytest.raises(ConfigError, match="--tp 4 must divide the model's KV heads"):
        rank_config(cfg, 4)
