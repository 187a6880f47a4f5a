"""Paged decode attention, Triton kernel against the torch path, over context lengths.

For each context length: `--batch` sequences decoding one token each, all with that context, their
blocks scattered over a pool (a random permutation). Timed per layer call:
- triton: the in-place kernel (engine/attention/triton_kernel.py), one launch;
- torch: the engine's torch path (TorchPagedAttention: the blocks gathered, then SDPA with a mask).
Both outputs are compared (max difference), and each call's bytes (the K/V it must read) give its
bandwidth and its share of `--peak-tbs` (4.8 TB/s, an H200's HBM3e). The defaults are
Llama-3.2-1B's attention (32 query heads, 8 KV heads, dimension 64) in bfloat16, blocks of 16.
With `--window N` each context is also run as a gpt-oss sliding layer (a window of N keys and a
sink logit per head): both paths again, compared, and timed (`windowed`; the kernel reads only the
blocks its window reaches).

The JSON (`--json`) is rewritten after every context length; past `--deadline` no new one starts.
On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1): the dry run, at tiny sizes.

    python benchmarks/gpu_check/gpu_paged_attention.py [--device cuda] [--contexts 256,1024,4096,16384] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # NOTE: before Triton is first imported

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from benchmarks.gpu_check.gpu_models import H200_TBPS  # noqa: E402
from benchmarks.gpu_check.gpu_results import Deadline, add_deadline, attempt, write_json  # noqa: E402
from hpcinfer.engine.attention.paged import DecodeGroup, PagedBatch, TorchPagedAttention  # noqa: E402
from hpcinfer.engine.kvcache.pools import KVCache, KVLayout  # noqa: E402


def timed(fn: Callable[[], torch.Tensor], device: torch.device, iters: int) -> float:
    """Seconds a call, after two untimed (compile, autotune, buffers grown)."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def one_context(args: argparse.Namespace, context: int) -> dict[str, Any]:
    from hpcinfer.engine.attention.triton_kernel import paged_attention

    device, dtype, bs = args.device, args.torch_dtype, args.block_size
    width = -(-context // bs)
    layout = KVLayout(1, args.kv_heads, args.head_dim, bs, dtype)
    cache = KVCache(layout, args.batch * width + 1, device)
    gen = torch.Generator(device=device).manual_seed(context)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen, device=device, dtype=torch.float32).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen, device=device, dtype=torch.float32).to(dtype))
    tables = torch.randperm(args.batch * width, generator=gen, device=device).view(args.batch, width)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen, device=device).to(dtype)
    lens = torch.full((args.batch,), context, device=device)
    rows = torch.arange(args.batch, device=device)
    keys = torch.arange(width * bs, device=device)
    mask = torch.zeros(args.batch, width * bs, dtype=dtype, device=device)
    mask.masked_fill_(keys[None, :] >= lens[:, None], -torch.inf)
    group = DecodeGroup(0, args.batch, tables, mask.view(args.batch, 1, 1, -1), lens)
    torch_path = TorchPagedAttention(cache).bind(PagedBatch(slots=rows, decodes=[group]))
    out = torch.empty_like(q)

    def triton_call() -> torch.Tensor:
        return paged_attention(q, cache.k[0], cache.v[0], tables, rows, lens, out)

    def torch_call() -> torch.Tensor:
        return torch_path._decode(0, group, q)

    diff = float((triton_call().float() - torch_call().float()).abs().max())
    read = args.batch * context * 2 * args.kv_heads * args.head_dim * cache.k.element_size()
    figures: dict[str, Any] = {"context": context, "batch": args.batch, "kv_bytes": read, "max_diff": diff}
    for name, fn in (("triton", triton_call), ("torch", torch_call)):
        seconds = timed(fn, device, args.iters)
        figures[name] = {
            "us": seconds * 1e6,
            "tb_per_s": read / seconds / 1e12,
            "bandwidth_utilisation": read / seconds / (args.peak_tbs * 1e12),
        }
    figures["triton_speedup"] = figures["torch"]["us"] / figures["triton"]["us"]
    if args.window:
        figures["windowed"] = windowed(args, cache, q, tables, rows, lens, group, out)
    return figures


def windowed(args: argparse.Namespace, cache: KVCache, q: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
             lens: torch.Tensor, group: DecodeGroup, out: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """The same decode as a gpt-oss sliding layer: `--window` keys and a sink per head, both paths."""
    from hpcinfer.engine.attention.triton_kernel import paged_attention

    window = args.window
    sinks = torch.randn(args.heads, generator=torch.Generator(device=q.device).manual_seed(1), device=q.device)
    torch_path = TorchPagedAttention(cache).bind(PagedBatch(slots=rows, decodes=[group]))
    torch_path.windows = (window,)  # NOTE: the one layer, as a sliding one

    def triton_call() -> torch.Tensor:
        return paged_attention(q, cache.k[0], cache.v[0], tables, rows, lens, out, window=window, sinks=sinks)

    def torch_call() -> torch.Tensor:
        return torch_path._decode(0, group, q, sinks.to(q.dtype))

    diff = float((triton_call().float() - torch_call().float()).abs().max())
    figures: dict[str, Any] = {"window": window, "max_diff": diff}
    read = args.batch * min(window, int(lens[0])) * 2 * args.kv_heads * args.head_dim * cache.k.element_size()
    for name, fn in (("triton", triton_call), ("torch", torch_call)):
        seconds = timed(fn, q.device, args.iters)
        figures[name] = {"us": seconds * 1e6, "tb_per_s": read / seconds / 1e12}
    figures["triton_speedup"] = figures["torch"]["us"] / figures["triton"]["us"]
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--contexts", default=None, help="comma-separated (default: 256,1024,4096,16384 on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="decoding sequences (default: 64 on CUDA, 2 on CPU)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--window", type=int, default=0, help="also run each context as a sliding layer with sinks")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default: 20 on CUDA, 2 on CPU)")
    p.add_argument("--peak-tbs", type=float, default=H200_TBPS)
    p.add_argument("--json", type=Path, default=None)
    add_deadline(p)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    args.dtype = ("bfloat16" if cuda else "float32") if args.dtype == "auto" else args.dtype
    args.torch_dtype = getattr(torch, args.dtype)
    args.contexts = [int(x) for x in (args.contexts or ("256,1024,4096,16384" if cuda else "16,64")).split(",")]
    args.batch = args.batch or (64 if cuda else 2)
    args.iters = args.iters or (20 if cuda else 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = Deadline(args.deadline)
    gpu = f" ({torch.cuda.get_device_name(args.device)})" if args.device.type == "cuda" else ""
    run = {
        "device": str(args.device) + gpu,
        "dtype": args.dtype,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "peak_tbs": args.peak_tbs,
    }
    results: list[dict[str, Any]] = []
    tolerance = 2e-2 if args.torch_dtype != torch.float32 else 1e-4
    print(f"paged decode attention on {run['device']}, {args.dtype}, {args.batch} sequences; per layer call:")
    for context in args.contexts:
        results.append({"context": context, "status": "running"})
        if args.json is not None:
            write_json(args.json, {"run": run, "contexts": results})
        figures, failed = attempt(f"context {context}", lambda c=context: one_context(args, c), deadline)
        results[-1] = {"context": context, **(failed or {"status": "ok", **(figures or {})})}
        if figures is not None:
            worst = max(figures["max_diff"], figures.get("windowed", {}).get("max_diff", 0.0))
            if worst > tolerance:
                results[-1] |= {"status": "error", "error": f"triton vs torch max diff {worst:.2e}"}
            t, p = figures["triton"], figures["torch"]
            print(
                f"  context {context:>6}: triton {t['us']:9.1f} us ({t['bandwidth_utilisation']:6.1%} of "
                f"{args.peak_tbs} TB/s), torch {p['us']:9.1f} us ({p['bandwidth_utilisation']:6.1%}): "
                f"{figures['triton_speedup']:.2f}x; max diff {figures['max_diff']:.1e}",
                flush=True,
            )
            if "windowed" in figures:
                w = figures["windowed"]
                print(f"    window {w['window']} + sinks: triton {w['triton']['us']:9.1f} us, torch "
                      f"{w['torch']['us']:9.1f} us: {w['triton_speedup']:.2f}x; max diff {w['max_diff']:.1e}",
                      flush=True)  # fmt: skip
        if args.json is not None:
            write_json(args.json, {"run": run, "contexts": results})
    failed = [r for r in results if r["status"] == "error"]
    return 1 if failed or not any(r["status"] == "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
