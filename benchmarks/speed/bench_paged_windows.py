"""Long answers on a sliding-window model: paged windows (a local layer's blocks freed once every
window has left them) against every layer keeping every key, in one KV pool of the same bytes.

A random Gemma-3-shaped checkpoint (bench_decoders.py's: 640 hidden, 12 layers, 4 heads of 256, 1
KV head, local layers five in six) with a `--window`-token window answers `--prompts` prompts of
`--length` random tokens with `--new-tokens` each (greedy, EOS ignored) in the native engine on the
CPU, with a pool of `--kv-memory`, each way in turn after a warm-up. Printed per way: the KV bytes
held at the peak, what full attention would have held for the same sequences, preemptions (a
sequence sent back to recompute for lack of blocks), seconds, and whether the answers are equal.

    python benchmarks/speed/bench_paged_windows.py [--prompts 16] [--length 64] [--new-tokens 512]
        [--window 128] [--kv-memory 96MiB]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--kv-memory", default="96MiB")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch

    from benchmarks.speed.bench_decoders import load_native
    from hpcinfer.engine.engine import Engine, EngineConfig
    from hpcinfer.engine.kvcache.pools import parse_kv_memory
    from hpcinfer.engine.sequence import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line(torch.get_num_threads()))
    model = load_native("gemma3", sliding_window=args.window)
    windows = model.cfg.layer_windows
    print(f"model: Gemma-3-shaped, {len(windows)} layers, window {args.window} on {sum(w > 0 for w in windows)}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 29000, (args.length,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    memory = parse_kv_memory(args.kv_memory)
    results = {}
    for paged in (False, True):
        config = EngineConfig(max_num_seqs=args.prompts, kv_cache_memory=memory, prefix_cache=False,
                              page_windows=paged)  # fmt: skip
        engine = Engine(model, config)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        engine.stats.preemptions = 0
        start = time.perf_counter()
        answers = [s.completion for s in engine.generate(prompts, params)]
        took = time.perf_counter() - start
        per_block = engine.cache.layout.bytes_per_block
        held, full = engine.blocks.peak_used * per_block, engine.blocks.peak_full_attention * per_block
        results[paged] = (took, answers, held, full, engine.scheduler.preemptions)
    print(f"{args.prompts} prompts of {args.length} tokens, {args.new_tokens} new tokens each, "
          f"a KV pool of {memory / 2**20:.0f} MiB")  # fmt: skip
    for paged, name in ((False, "every layer keeps every key"), (True, "paged windows")):
        took, _, held, full, preempted = results[paged]
        print(f"  {name:28s} {took:7.2f} s   KV held at peak {held / 2**20:7.1f} MiB "
              f"(full attention: {full / 2**20:7.1f} MiB)   preemptions {preempted}")  # fmt: skip
    same = sum(a == b for a, b in zip(results[False][1], results[True][1], strict=True))
    print(f"  speed: {results[False][0] / results[True][0]:.2f}x   same answers: {same}/{args.prompts}")


if __name__ == "__main__":
    main()
