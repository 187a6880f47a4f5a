"""Generation throughput: hpcinfer's engine against transformers' static and continuous batching.

One process, one random Llama checkpoint of about 50M parameters built here (hidden 512, 8 layers,
8 heads, 4 KV heads), 128 prompts of 16-256 tokens with max_tokens drawn from 16-128 and
ignore_eos. "Useful" tokens are the ones each request asked for: a static batch that runs to its
longest request generates more, and those extra tokens are waste.

    python benchmarks/bench_generate.py [--prompts 128] [--skip-static] [--skip-cb]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from hpcinfer.models.decoder_checkpoint import inspect_decoder, load_decoder
from hpcinfer.models.tiny_decoder import build_tiny_decoder
from hpcinfer.tasks.generate.engine import Engine, EngineConfig
from hpcinfer.tasks.generate.sequence import SamplingParams


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    return prompts, [rng.randint(16, 128) for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_hpcinfer(model, prompts, max_tokens, args) -> tuple[tuple[float, float], list[list[int]], str]:
    cfg = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=1 << 30,
        timed=True,
    )
    engine = Engine(model, cfg, eos_token_ids=())
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    start, cpu = time.perf_counter(), time.process_time()
    seqs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    s = engine.stats
    ttft = [(q.first_token_s - start) * 1e3 for q in seqs]
    tpot = [(q.finish_s - q.first_token_s) / max(q.num_completion - 1, 1) * 1e3 for q in seqs]
    busy = s.model_s + s.gather_s + s.sample_s + s.host_s
    lines = [
        f"  steps {s.steps}, prefill tokens {s.prefill_tokens}, decode tokens {s.decode_tokens}, "
        f"preemptions {s.preemptions}, peak KV blocks {s.peak_blocks}/{s.num_blocks}",
        f"  occupancy (running / max-num-seqs, mean over steps) {s.mean_occupancy:.2f}",
        f"  TTFT p50 {pct(ttft, 0.5):.0f} ms p99 {pct(ttft, 0.99):.0f} ms (all requests queued at t=0); "
        f"TPOT p50 {pct(tpot, 0.5):.1f} ms p99 {pct(tpot, 0.99):.1f} ms",
        f"  step time: model {s.model_s / busy:.0%}, attention gather {s.gather_s / busy:.0%}, "
        f"sampling {s.sample_s / busy:.0%}, host/Python {s.host_s / busy:.0%} (of {busy:.1f} s)",
    ]
    return (wall, cpu), [q.completion for q in seqs], "\n".join(lines)


def run_static(ref, prompts, max_tokens, batch: int) -> tuple[tuple[float, float], list[list[int]]]:
    outs: list[list[int]] = []
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        group, caps = prompts[i : i + batch], max_tokens[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            gen = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(caps), do_sample=False)
        outs += [row[width : width + cap].tolist() for row, cap in zip(gen, caps, strict=True)]
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


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return f"{same}/{len(ours)} requests token-identical"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--static-batches", default="8,16,32,64")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-cb", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_decoder(
            Path(tmp) / "llama50m",
            hidden=512,
            layers=8,
            heads=8,
            kv_heads=4,
            intermediate=1536,
            max_positions=1024,
            initializer_range=0.05,
            seed=0,
            tokenizer_dir=Path(__file__).resolve().parent / "minilm_tokenizer",
        )
        info = inspect_decoder(path)
        model = load_decoder(info, torch.device("cpu"), torch.float32)
        params = sum(p.numel() for p in model.parameters())
        ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ref.generation_config.eos_token_id = None
        ref.generation_config.pad_token_id = 0
        paged = None
        if not args.skip_cb:
            paged = transformers.LlamaForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="paged|sdpa"
            ).eval()
        prompts, max_tokens = workload(args.prompts, info.config.vocab_size)
    useful = sum(max_tokens)
    print(f"model: random Llama, {params / 1e6:.0f}M parameters, float32, {torch.get_num_threads()} CPU threads")
    print(
        f"workload: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(mean {statistics.mean(map(len, prompts)):.0f}), max_tokens 16-128, {useful} useful output tokens"
    )
    (wall, cpu), ours, detail = run_hpcinfer(model, prompts, max_tokens, args)
    rows = [("hpcinfer (continuous batching, paged KV)", wall, cpu, "")]
    print(f"hpcinfer: {useful / wall:.0f} useful tokens/s ({wall:.1f} s, {cpu:.1f} CPU s)\n{detail}", flush=True)
    if not args.skip_static:
        for b in (int(x) for x in args.static_batches.split(",")):
            (t, c), outs = run_static(ref, prompts, max_tokens, b)
            rows.append((f"transformers generate, static batch {b}", t, c, agreement(ours, outs)))
            print(f"static {b}: {useful / t:.0f} useful tokens/s ({t:.1f} s, {c:.1f} CPU s), {rows[-1][3]}", flush=True)
    if not args.skip_cb:
        (t, c), outs = run_continuous(paged, prompts, max_tokens)
        rows.append(("transformers continuous batching (paged|sdpa)", t, c, agreement(ours, outs)))
        print(f"continuous: {useful / t:.0f} useful tokens/s ({t:.1f} s, {c:.1f} CPU s), {rows[-1][3]}", flush=True)
    # NOTE: on shared cores wall time moves with the neighbours' load; CPU time much less so.
    print("\n| engine | useful tokens/s | hpcinfer is | per CPU second | hpcinfer is | same greedy tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for name, t, c, agree in rows:
        print(f"| {name} | {useful / t:.0f} | {t / wall:.2f}x | {useful / c:.0f} | {c / cpu:.2f}x | {agree or '-'} |")


if __name__ == "__main__":
    main()
