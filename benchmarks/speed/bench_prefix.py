"""Prefix caching and prefix-aware ordering on a batch that repeats its system prompts.

512 prompts: 16 system prompts of ~400 tokens, each followed by a distinct ~40-token question,
shuffled; max_tokens=16 (ignore_eos). Three runs of `hpcinfer run` on the same file and a random
Llama checkpoint built here (hidden 256, 4 layers): caching off, caching on with the window
admitted in file order, caching on with prefix-aware ordering. Prints wall time, prompt tokens/s
(prompt tokens of the file / wall time), the prefill tokens actually computed, and the hit rate
against the theoretical maximum for the file (every distinct block computed once).

    python benchmarks/speed/bench_prefix.py [--prompts 512] [--threads 1] [--kv-blocks N] [--skip-off]

`--kv-blocks N` bounds the KV pool (blocks of 16 tokens) so that not every system prompt stays
cached: there admission order decides how often a prefix is evicted and computed again.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from hpcinfer.api import run  # noqa: E402
from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig  # noqa: E402
from hpcinfer.engine.kvcache.block_manager import max_hit_rate  # noqa: E402
from tests.fixtures.tiny_decoder import build_tiny_decoder  # noqa: E402

RUNS = (
    ("caching off", {"prefix_cache": False, "prefix_order": False}),
    ("caching on, file order", {"prefix_cache": True, "prefix_order": False}),
    ("caching on, prefix order", {"prefix_cache": True, "prefix_order": True}),
)


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, vocab) for _ in range(rng.randint(380, 420))] for _ in range(16)]
    prompts = [systems[i % 16] + [rng.randrange(1000, vocab) for _ in range(rng.randint(30, 50))] for i in range(n)]
    rng.shuffle(prompts)
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)  # shared cores: one thread wastes less
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV pool size in blocks [default: 1 GiB]")
    ap.add_argument("--skip-off", action="store_true", help="only the two runs with caching on")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = build_tiny_decoder(
            root / "model", "LlamaForCausalLM", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768,
            max_positions=1024, seed=0,
        )  # fmt: skip
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        prompts = workload(args.prompts, vocab)
        src = root / "in.jsonl"
        src.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n" for i, p in enumerate(prompts)))
        total = sum(len(p) for p in prompts)
        best = max_hit_rate(prompts, 16)
        print(f"{len(prompts)} prompts, {total:,} prompt tokens, theoretical max hit rate {best:.4f}")
        print(f"torch threads {args.threads}, max_tokens {args.max_tokens}, block size 16, budget 2048 tokens/step\n")
        results, texts = [], []
        layout_bytes = 2 * 4 * 16 * 2 * 64 * 4  # K and V, 4 layers, 16 tokens, 2 KV heads of 64, float32
        memory = None if args.kv_blocks is None else str(args.kv_blocks * layout_bytes)
        print(f"KV pool: {'1 GiB' if memory is None else f'{args.kv_blocks} blocks'}\n")
        for name, options in RUNS[1:] if args.skip_off else RUNS:
            out = root / f"{name.replace(' ', '_').replace(',', '')}.parquet"
            config = RunConfig(
                input=InputConfig((str(src),)),
                model=str(ckpt),
                device=DeviceConfig(device="cpu", threads=args.threads),
                output=OutputConfig(str(out)),
                pipeline=PipelineConfig(progress="off"),
                generate=GenerateConfig(max_tokens=args.max_tokens, ignore_eos=True, kv_cache_memory=memory, **options),
            )
            cpu = time.process_time()
            report = run(config)
            cpu = time.process_time() - cpu
            table = pq.read_table(out)
            assert table.column("id").to_pylist() == [str(i) for i in range(len(prompts))], "output not in input order"
            texts.append(table.column("text").to_pylist())
            results.append((name, report, cpu))
        base = results[0][1].wall_s
        print(
            "| run | wall s | CPU s | prompt tok/s | prefill computed | hit rate | of max | preemptions | speed-up |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        )
        for name, r, cpu in results:
            print(
                f"| {name} | {r.wall_s:.1f} | {cpu:.1f} | {total / r.wall_s:,.0f} | {r.prefill_tokens:,} | "
                f"{r.prefix_hit_rate:.4f} | {r.prefix_hit_rate / best:.3f} | {r.preemptions:,} | "
                f"{base / r.wall_s:.2f}x |"
            )
        same = sum(len(set(answers)) == 1 for answers in zip(*texts, strict=True))
        print(f"\nspeed-up: against the first run; answers equal across the runs: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
