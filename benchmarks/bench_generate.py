"""Generation throughput: hpcinfer's engine against transformers' static and continuous batching.

One process, one random Llama checkpoint built here (`--shape`: tiny; 50m, hidden 512, 8 layers,
8 heads, 4 KV heads, the CPU default; llama-1b, Llama-3.2-1B's shape with the 30,522-token
tokenizer in benchmarks/minilm_tokenizer, the GPU default), 128 prompts of 16-256 tokens with
max_tokens drawn from 16-128 and ignore_eos. "Useful" tokens are the ones each request asked for:
a static batch that runs to its longest request generates more, and those extra tokens are waste.

hpcinfer runs once per `--variants` entry (attention kernel, decode graphs, FP8 weights and KV
cache); transformers'
`generate` once per `--static-batches` size, and its continuous batching (`paged|sdpa`, the
manager behind `generate_batch`) once. Every engine's greedy tokens are compared with the first
hpcinfer variant's; on CUDA each engine's peak memory is reported.

    python benchmarks/bench_generate.py [--device cpu|cuda] [--shape tiny|50m|llama-1b] [--prompts 128]
        [--variants 'attention=torch,graphs=0;attention=triton,graphs=1;kv=fp8,quantize=fp8'] [--static-batches 8,16]
        [--skip-static] [--skip-cb] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # NOTE: runs from a checkout, installed or not

from hpcinfer.models.decoder_checkpoint import inspect_decoder, load_decoder  # noqa: E402
from hpcinfer.models.fp8 import quantize_decoder_fp8  # noqa: E402
from hpcinfer.models.tiny_decoder import build_tiny_decoder  # noqa: E402
from hpcinfer.tasks.generate.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.tasks.generate.kv_cache import kv_storage, parse_kv_memory  # noqa: E402
from hpcinfer.tasks.generate.sequence import SamplingParams  # noqa: E402

TOKENIZER = Path(__file__).resolve().parent / "minilm_tokenizer"
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128},
    "50m": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536},
    "llama-1b": {
        "hidden": 2048,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "intermediate": 8192,
        "tie": True,
        "rope_theta": 500000.0,
    },
}


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    return prompts, [rng.randint(16, 128) for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def parse_variants(text: str) -> list[dict[str, Any]]:
    """'attention=torch,graphs=0;attention=auto,kv=fp8,quantize=fp8' -> [{'attention': 'torch', ...}, ...]."""
    out = []
    for part in filter(None, (x.strip() for x in text.split(";"))):
        fields = dict(kv.split("=", 1) for kv in part.split(","))
        if set(fields) - {"attention", "graphs", "kv", "quantize"}:
            raise SystemExit(f"bench_generate: unknown variant field in {part!r} (attention, graphs, kv, quantize)")
        out.append(
            {
                "attention": fields.get("attention", "auto"),
                "graphs": fields.get("graphs", "0") == "1",
                "kv": fields.get("kv", "auto"),  # auto | fp8: the KV cache's storage (--kv-cache-dtype)
                "quantize": fields.get("quantize", "none"),  # none | fp8: the linear weights (--quantize)
            }
        )
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run_hpcinfer(model, prompts, max_tokens, args, variant) -> tuple[tuple[float, float], list[list[int]], dict]:
    cfg = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        timed=True,
        cuda_graphs=variant["graphs"],
        attention=variant["attention"],
        kv_storage=kv_storage(variant["kv"]),
    )
    if variant["quantize"] == "fp8":
        model = quantize_decoder_fp8(copy.deepcopy(model), args.device)
    engine = Engine(model, cfg, eos_token_ids=())
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    engine.generate([prompts[0]], [SamplingParams(max_tokens=4, ignore_eos=True)])  # warm-up: kernels, graphs
    engine.stats = type(engine.stats)(num_blocks=engine.stats.num_blocks)
    sync(args.device)
    start, cpu = time.perf_counter(), time.process_time()
    seqs = engine.generate(prompts, params)
    sync(args.device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    s = engine.stats
    ttft = [(q.first_token_s - start) * 1e3 for q in seqs]
    tpot = [(q.finish_s - q.first_token_s) / max(q.num_completion - 1, 1) * 1e3 for q in seqs]
    busy = s.model_s + s.gather_s + s.sample_s + s.host_s
    graphs = engine.runner.graphs
    detail = {
        "attention": engine.runner.attention.name,
        "steps": s.steps,
        "preemptions": s.preemptions,
        "kv_blocks": s.num_blocks,
        "peak_kv_blocks": s.peak_blocks,
        "graphs_captured": graphs.captured if graphs is not None else 0,
        "graph_replays": graphs.replays if graphs is not None else 0,
        "ttft_p50_ms": pct(ttft, 0.5),
        "tpot_p50_ms": pct(tpot, 0.5),
        "split": {k: getattr(s, f"{k}_s") / busy for k in ("model", "gather", "sample", "host")} if busy else {},
    }
    del engine
    return (wall, cpu), [q.completion for q in seqs], detail


def run_static(ref, prompts, max_tokens, batch: int, device) -> tuple[tuple[float, float], list[list[int]]]:
    outs: list[list[int]] = []
    sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        group, caps = prompts[i : i + batch], max_tokens[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        with torch.inference_mode():
            gen = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(caps), do_sample=False)
        outs += [row[width : width + cap].tolist() for row, cap in zip(gen, caps, strict=True)]
    sync(device)
    return (time.perf_counter() - start, time.process_time() - cpu), outs


def run_continuous(ref, prompts, max_tokens) -> tuple[tuple[float, float], list[list[int]]]:
    """transformers' continuous batching (the manager behind `generate_batch`), per-request max_new_tokens."""
    gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None)
    start, cpu = time.perf_counter(), time.process_time()
    with ref.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=5) as manager:
        ids = [
            manager.add_request(p, f"r{i}", max_new_tokens=m)
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        results = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out.generated_tokens
    return (time.perf_counter() - start, time.process_time() - cpu), [list(results[i]) for i in ids]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(ours, theirs, strict=True))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None, help="default: llama-1b on CUDA, 50m on CPU")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", default=None, help="default: 0.5 of free memory on CUDA, 1GiB on CPU")
    parser.add_argument(
        "--variants",
        default=None,
        help="hpcinfer settings (default: torch eager; on CUDA also triton eager and auto with decode graphs)",
    )
    parser.add_argument("--static-batches", default=None, help="default: 64,128 on CUDA, 8,16,32,64 on CPU")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-cb", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    args.shape = args.shape or ("llama-1b" if cuda else "50m")
    args.dtype = ("bfloat16" if cuda else "float32") if args.dtype == "auto" else args.dtype
    args.kv_cache_memory = parse_kv_memory(args.kv_cache_memory or ("0.5" if cuda else "1GiB"))
    default_variants = (
        "attention=torch,graphs=0;attention=triton,graphs=0;attention=auto,graphs=1;"
        "attention=auto,graphs=1,quantize=fp8;attention=torch,graphs=1,kv=fp8"
    )
    args.variants = parse_variants(args.variants or (default_variants if cuda else "attention=torch,graphs=0"))
    args.static_batches = [int(x) for x in (args.static_batches or ("64,128" if cuda else "8,16,32,64")).split(",")]
    return args


def main() -> int:
    args = parse_args()
    device, dtype = args.device, getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_decoder(
            Path(tmp) / args.shape,
            max_positions=1024,
            initializer_range=0.05,
            seed=0,
            tokenizer_dir=TOKENIZER,
            dtype=args.dtype,
            init_device=str(device),
            **SHAPES[args.shape],
        )
        fresh_peak(device)
        info = inspect_decoder(path)
        model = load_decoder(info, device, dtype)
        weights_gib = peak_gib(device)
        params = sum(p.numel() for p in model.parameters())
        static_ref = cb_ref = None
        if not args.skip_static:
            static_ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            static_ref.generation_config.eos_token_id = None
            static_ref.generation_config.pad_token_id = 0
        if not args.skip_cb:
            cb_ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="paged|sdpa")
            cb_ref = cb_ref.to(device).eval()
        prompts, max_tokens = workload(args.prompts, info.config.vocab_size)
    useful = sum(max_tokens)
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"model: random Llama, shape {args.shape}, {params / 1e6:.0f}M parameters, {args.dtype}, on {device}{gpu}")
    print(
        f"workload: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(mean {statistics.mean(map(len, prompts)):.0f}), max_tokens 16-128, {useful} useful output tokens"
    )
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None

    def record(name: str, wall: float, cpu: float, tokens: list[list[int]], **more: Any) -> None:
        nonlocal reference
        reference = tokens if reference is None else reference
        row = {"engine": name, "wall_s": wall, "cpu_s": cpu, "useful_tokens_per_s": useful / wall}
        row |= {"same_greedy_tokens": agreement(reference, tokens), "peak_gib": peak_gib(device), **more}
        rows.append(row)
        peak = f", peak {row['peak_gib']:.2f} GiB" if row["peak_gib"] is not None else ""
        print(
            f"{name}: {row['useful_tokens_per_s']:,.0f} useful tokens/s ({wall:.2f} s, {cpu:.1f} CPU s{peak}), "
            f"{row['same_greedy_tokens']}/{len(prompts)} token-identical to the first",
            flush=True,
        )

    for variant in args.variants:
        fresh_peak(device)
        (wall, cpu), tokens, detail = run_hpcinfer(model, prompts, max_tokens, args, variant)
        name = f"hpcinfer {detail['attention']}{' + decode graphs' if variant['graphs'] else ''}"
        name += "".join(
            f" + fp8 {what}"
            for what, on in (("weights", variant["quantize"] == "fp8"), ("KV", variant["kv"] == "fp8"))
            if on
        )
        record(name, wall, cpu, tokens, **detail)
        split = ", ".join(f"{k} {v:.0%}" for k, v in detail["split"].items())
        print(
            f"  steps {detail['steps']}, preemptions {detail['preemptions']}, KV blocks {detail['peak_kv_blocks']}"
            f"/{detail['kv_blocks']}, graphs {detail['graphs_captured']} captured / {detail['graph_replays']} "
            f"replays, TTFT p50 {detail['ttft_p50_ms']:.0f} ms, TPOT p50 {detail['tpot_p50_ms']:.1f} ms; {split}"
        )
    if static_ref is not None:
        for batch in args.static_batches:
            fresh_peak(device)
            (wall, cpu), tokens = run_static(static_ref, prompts, max_tokens, batch, device)
            record(f"transformers generate, static batch {batch}", wall, cpu, tokens)
    if cb_ref is not None:
        fresh_peak(device)
        (wall, cpu), tokens = run_continuous(cb_ref, prompts, max_tokens)
        record("transformers continuous batching (paged|sdpa)", wall, cpu, tokens)
    best_hpc = max((r for r in rows if r["engine"].startswith("hpcinfer")), key=lambda r: r["useful_tokens_per_s"])
    print("\n| engine | useful tokens/s | best hpcinfer is | same greedy tokens | peak GiB |")
    print("|---|---:|---:|---|---:|")
    for r in rows:
        ratio = best_hpc["useful_tokens_per_s"] / r["useful_tokens_per_s"]
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(
            f"| {r['engine']} | {r['useful_tokens_per_s']:,.0f} | {ratio:.2f}x | "
            f"{r['same_greedy_tokens']}/{len(prompts)} | {peak} |"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "shape": args.shape,
            "parameters": params,
            "dtype": args.dtype,
            "device": str(device) + gpu,
            "prompts": len(prompts),
            "useful_tokens": useful,
            "weights_peak_gib": weights_gib,
        }
        args.json.write_text(json.dumps({"run": summary, "engines": rows}, indent=1) + "\n", encoding="utf-8")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
