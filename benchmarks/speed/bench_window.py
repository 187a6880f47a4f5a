"""Long contexts on a sliding-window model: the torch path reading each local layer's window only,
against reading the whole context and masking it, side by side in one process.

A random Gemma-3-shaped checkpoint (bench_decoders.py's: 640 hidden, 12 layers, 4 heads of 256, 1
KV head, a 512-token window on five layers in six) answers `--prompts` prompts of `--length`
random tokens with `--new-tokens` each (greedy, EOS ignored), in the native engine on the CPU:

- window: a local layer gathers only the blocks its window reaches, and a long prefill chunk
  attends in blocks of `window` queries, each to the keys its window reaches (the engine as it runs);
- whole: every layer gathers the whole context and masks what is before the window, and a
  prefill chunk's queries score every key before masking (the engine before these changes, kept
  here by replacing the window's gather and the blocked prefill).

Both are timed after a warm-up, in the same process, in turn; the answers must be equal.

    python benchmarks/speed/bench_window.py [--prompts 16] [--length 2048] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line  # noqa: E402


def whole_context(self, group, window):  # noqa: ANN001, ANN201
    """The gather before windows were read alone: every block of the table, the window masked."""
    import torch

    mask = group.mask
    keys = torch.arange(mask.shape[-1], device=mask.device)
    old = keys[None, :] <= (group.lens - 1 - window)[:, None]
    return group.blocks, mask.masked_fill(old.view(mask.shape), -torch.inf)


def one_call(q, k, v, q_start, k_start, window, softcap=None, sinks=None):  # noqa: ANN001, ANN201
    """The prefill before blocks: every query scored against every key, the window masked."""
    import torch

    from hpcinfer.models.attention import in_window, scaled_dot_product_attention

    queries = torch.arange(q_start, q_start + q.shape[-2])
    seen = in_window(queries, torch.arange(k_start, k_start + k.shape[-2]), window)
    return scaled_dot_product_attention(q, k, v, seen, False, softcap, sinks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch

    from benchmarks.speed.bench_decoders import load_native
    from hpcinfer.engine.attention import paged
    from hpcinfer.engine.attention.paged import TorchPagedAttention
    from hpcinfer.engine.engine import Engine, EngineConfig
    from hpcinfer.engine.sequence import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line(torch.get_num_threads()))
    model = load_native("gemma3")
    print(f"model: Gemma-3-shaped, windows {sorted(set(model.cfg.layer_windows))}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 29000, (args.length,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    # NOTE: every layer keeping every key (no paged windows): the reads alone differ, as measured
    config = EngineConfig(max_num_seqs=args.prompts, kv_cache_memory=2 << 30, prefix_cache=False, page_windows=False)
    windowed, blocked = TorchPagedAttention._window_blocks, paged.windowed_attention
    results = {}
    for name in ("whole", "window", "whole", "window"):  # NOTE: in turn, twice: the second of each counts
        TorchPagedAttention._window_blocks = whole_context if name == "whole" else windowed
        paged.windowed_attention = one_call if name == "whole" else blocked
        engine = Engine(model, config)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        answers = [s.completion for s in engine.generate(prompts, params)]
        results[name] = (time.perf_counter() - start, answers)
    TorchPagedAttention._window_blocks, paged.windowed_attention = windowed, blocked
    (whole_s, whole), (window_s, window) = results["whole"], results["window"]
    same = sum(a == b for a, b in zip(whole, window, strict=True))
    print(f"{args.prompts} prompts of {args.length} tokens, {args.new_tokens} new tokens each")
    print(f"  whole context: {whole_s:7.2f} s")
    print(f"  window only:   {window_s:7.2f} s   {whole_s / window_s:.2f}x")
    print(f"  same answers:  {same}/{len(whole)}")


if __name__ == "__main__":
    main()
