"""Generation throughput: hpcinfer's engine against transformers' static and continuous batching.

One process, one random Llama checkpoint built here (`--shape`: tiny; 50m, hidden 512, 8 layers,
8 heads, 4 KV heads, the CPU default; llama-1b, Llama-3.2-1B's shape with its 128,256-token
vocabulary, the GPU default; the 30,522-token tokenizer in benchmarks/minilm_tokenizer, the
prompts being token ids). The workload: `--prompts` prompts (CPU: 128 of 16-256 tokens with
max_tokens 16-128; GPU: 512 of 16-1024 tokens, log-uniform, with max_tokens 16-256), all with
ignore_eos. "Useful" tokens are the ones each request asked for: a static batch that runs to its
longest request generates more, and those extra tokens are waste.

hpcinfer runs once per `--variants` entry (attention kernel, decode graphs, FP8 weights and KV
cache; the first `--lead` of them before transformers, the rest after), after a warm-up on a
mixed mini-workload (prefills, continued chunks, decodes of several widths: kernels compiled,
graphs captured); transformers' `generate` once per `--static-batches` size, and its continuous
batching (the manager behind `generate_batch`) once, timed from its first request after its own
warm-up (graph capture) and a mini-workload. Every engine's greedy tokens are compared with the
first hpcinfer variant's; each records the dtype it really ran in (a mismatch fails it).

Beside throughput, per engine: the device's busy share over the run (benchmarks/gpu_check/gpu_busy.py), peak
memory on CUDA, and a decode probe: `--probe` sequences of one prompt length decoding in lockstep,
the time of a decode step, the bytes it must read (every weight once and each sequence's K/V) and
so its memory-bandwidth utilisation against `--peak-tbs` (4.8 TB/s, an H200's HBM3e).

The JSON (`--json`) is rewritten after every engine (temp + rename); an engine that fails is
recorded with its error and the others go on; past `--deadline` no new engine starts.

    python benchmarks/speed/bench_generate.py [--device cpu|cuda] [--shape tiny|50m|llama-1b] [--prompts N]
        [--variants 'attention=torch,graphs=0;attention=triton,graphs=1;kv=fp8,quantize=fp8'] [--static-batches 8,16]
        [--skip-static] [--skip-cb] [--probe B,P,K] [--deadline S] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from benchmarks.gpu_check.gpu_busy import BusySampler  # noqa: E402
from benchmarks.gpu_check.gpu_models import (  # noqa: E402
    DECODERS,
    H200_TBPS,
    build_decoder,
    decode_step_bytes,
    kv_bytes_per_token,
    read_config,
)
from benchmarks.gpu_check.gpu_results import Deadline, add_deadline, attempt, free_device_memory, write_json  # noqa: E402
from hpcinfer.engine.engine import Engine, EngineConfig  # noqa: E402
from hpcinfer.engine.kvcache.pools import kv_storage, parse_kv_memory  # noqa: E402
from hpcinfer.engine.sequence import SamplingParams  # noqa: E402
from hpcinfer.models.decoder_checkpoint import load_decoder  # noqa: E402
from hpcinfer.models.decoder_inspect import inspect_decoder  # noqa: E402
from hpcinfer.models.fp8 import quantize_decoder_fp8  # noqa: E402
from tests.fixtures.tiny_decoder import build_tiny_decoder  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[1] / "minilm_tokenizer"
SHAPES: dict[str, dict[str, Any]] = {  # built by build_tiny_decoder, with the tokenizer's vocabulary
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128},
    "50m": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536},
}
GPU_SHAPE = "llama-1b"  # gpu_models.DECODERS, with the model's own vocabulary


def workload(
    n: int, vocab: int, lengths: tuple[int, int], new: tuple[int, int], seed: int = 0, log: bool = False
) -> tuple[list[list[int]], list[int]]:
    """n prompts of random ids, lengths drawn in [lo, hi] (log-uniform with `log`: many short, some
    long, as real traffic), each with max_tokens drawn in new."""
    rng = random.Random(seed)

    def length() -> int:
        lo, hi = lengths
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) if log else rng.randint(lo, hi)

    prompts = [[rng.randrange(1000 % vocab, vocab) for _ in range(length())] for _ in range(n)]
    return prompts, [rng.randint(*new) for _ in range(n)]


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


def variant_name(variant: dict[str, Any], attention: str) -> str:
    name = f"hpcinfer {attention}{' + decode graphs' if variant['graphs'] else ''}"
    return name + "".join(
        f" + fp8 {what}"
        for what, on in (("weights", variant["quantize"] == "fp8"), ("KV", variant["kv"] == "fp8"))
        if on
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_peak(device: torch.device) -> None:
    free_device_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def weight_bytes(model: torch.nn.Module) -> int:
    """What a decode step reads of the weights: every tensor of the layers, the final norm and the
    LM head (the input embedding when tied: each step reads it whole as the LM head)."""
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    tensors = itertools.chain(model.layers.parameters(), model.layers.buffers(), [model.norm, head])
    return sum(t.numel() * t.element_size() for t in tensors)


def probe_figures(steps_s: float, steps: int, bytes_per_step: float, peak_tbs: float) -> dict[str, float]:
    step = steps_s / steps
    return {
        "decode_step_ms": step * 1e3,
        "decode_bytes_per_step": bytes_per_step,
        "decode_tb_per_s": bytes_per_step / step / 1e12,
        "decode_bandwidth_utilisation": bytes_per_step / step / (peak_tbs * 1e12),
    }


# --------------------------------------------------------------------------- hpcinfer


def engine_config(args: argparse.Namespace, variant: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        timed=True,
        cuda_graphs=variant["graphs"],
        attention=variant["attention"],
        kv_storage=kv_storage(variant["kv"]),
    )


def hpcinfer_probe(engine: Engine, model: torch.nn.Module, args: argparse.Namespace) -> dict[str, float]:
    """B sequences of P prompt tokens, prefilled, then K decode steps timed in lockstep."""
    batch, prompt, steps = args.probe
    rng = random.Random(7)
    vocab = model.cfg.vocab_size
    seqs = [
        engine.add([rng.randrange(vocab) for _ in range(prompt)], SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        for _ in range(batch)
    ]
    while any(s.num_completion < 2 for s in seqs):  # every prompt prefilled, every sequence decoding
        engine.step()
    contexts = [s.num_tokens for s in seqs]
    sync(args.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(args.device)
    elapsed = time.perf_counter() - start
    while engine.has_work:
        engine.step()
    kv = kv_bytes_per_token(args.hf_config, engine.cache.k.element_size())
    total = sum(decode_step_bytes(weight_bytes(model), kv, [c + i for c in contexts]) for i in range(steps))
    return probe_figures(elapsed, steps, total / steps, args.peak_tbs)


def run_hpcinfer(model, prompts, max_tokens, args, variant) -> dict[str, Any]:  # noqa: ANN001
    if variant["quantize"] == "fp8":
        model = quantize_decoder_fp8(copy.deepcopy(model), args.device)
    engine = Engine(model, engine_config(args, variant), eos_token_ids=())
    warm_prompts, warm_tokens = args.warmup
    engine.generate(warm_prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in warm_tokens])
    engine.stats = type(engine.stats)(num_blocks=engine.stats.num_blocks)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    sync(args.device)
    with BusySampler(args.device) as busy:
        start, cpu = time.perf_counter(), time.process_time()
        seqs = engine.generate(prompts, params)
        sync(args.device)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if model.norm.dtype != args.torch_dtype:
        raise AssertionError(f"hpcinfer ran in {model.norm.dtype}, not {args.dtype}")
    s = engine.stats
    ttft = [(q.first_token_s - start) * 1e3 for q in seqs]
    tpot = [(q.finish_s - q.first_token_s) / max(q.num_completion - 1, 1) * 1e3 for q in seqs]
    split_total = s.model_s + s.gather_s + s.sample_s + s.host_s
    graphs = engine.runner.graphs
    figures = {
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": [q.completion for q in seqs],
        "dtype": str(model.norm.dtype).removeprefix("torch."),
        "attention": engine.runner.attention.name,
        "steps": s.steps,
        "preemptions": s.preemptions,
        "kv_blocks": s.num_blocks,
        "peak_kv_blocks": s.peak_blocks,
        "graphs_captured": graphs.captured if graphs is not None else 0,
        "graph_replays": graphs.replays if graphs is not None else 0,
        "ttft_p50_ms": pct(ttft, 0.5),
        "tpot_p50_ms": pct(tpot, 0.5),
        "device_time_share": (s.model_s + s.gather_s + s.sample_s) / wall if wall else None,
        "split": {k: getattr(s, f"{k}_s") / split_total for k in ("model", "gather", "sample", "host")}
        if split_total
        else {},
        "peak_gib": peak_gib(args.device),
        **busy.figures(),
    }
    if args.probe:
        figures |= hpcinfer_probe(engine, model, args)
    return figures


# --------------------------------------------------------------------------- transformers


def load_reference(path: Path, args: argparse.Namespace, **kwargs: Any) -> Any:
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=args.torch_dtype, **kwargs)
    ref = ref.to(args.device).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ref


def model_dtype(ref: Any, args: argparse.Namespace) -> str:
    """The dtype the reference really holds its weights in; a mismatch fails the engine."""
    dtypes = {str(p.dtype).removeprefix("torch.") for p in ref.parameters()}
    if dtypes != {args.dtype}:
        raise AssertionError(f"transformers' model holds {sorted(dtypes)}, not {args.dtype}")
    return args.dtype


def static_generate(ref: Any, prompts: list[list[int]], max_new: int, device: torch.device) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new)
    return out[:, width:]


def run_static(ref, prompts, max_tokens, batch: int, args) -> dict[str, Any]:  # noqa: ANN001
    outs: list[list[int]] = []
    static_generate(ref, prompts[:2], 2, args.device)  # warm-up: kernels, cuBLAS
    sync(args.device)
    with BusySampler(args.device) as busy:
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(0, len(prompts), batch):
            group, caps = prompts[i : i + batch], max_tokens[i : i + batch]
            gen = static_generate(ref, group, max(caps), args.device)
            outs += [row[:cap].tolist() for row, cap in zip(gen, caps, strict=True)]
        sync(args.device)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    figures = {"wall_s": wall, "cpu_s": cpu, "tokens": outs, "dtype": model_dtype(ref, args)}
    figures |= {"peak_gib": peak_gib(args.device), **busy.figures()}
    if args.probe:
        figures |= static_probe(ref, args)
    return figures


def probe_prompts(args: argparse.Namespace) -> list[list[int]]:
    batch, prompt, _ = args.probe
    rng = random.Random(7)
    return [[rng.randrange(1000 % args.vocab, args.vocab) for _ in range(prompt)] for _ in range(batch)]


def subtract_prefill(run: Callable[[int], None], args: argparse.Namespace) -> float:
    """Seconds of K decode steps: a run of 1 + K new tokens less a run of 1 (the prefill), best of 2."""
    steps = args.probe[2]

    def timed(new: int) -> float:
        sync(args.device)
        start = time.perf_counter()
        run(new)
        sync(args.device)
        return time.perf_counter() - start

    return max(min(timed(1 + steps) for _ in range(2)) - min(timed(1) for _ in range(2)), 1e-9)


def reference_step_bytes(ref: Any, args: argparse.Namespace) -> float:
    batch, prompt, steps = args.probe
    inner = ref.model
    tensors = itertools.chain(inner.layers.parameters(), inner.norm.parameters(), ref.lm_head.parameters())
    weights = sum(t.numel() * t.element_size() for t in tensors)
    kv = kv_bytes_per_token(args.hf_config, next(ref.parameters()).element_size())
    return statistics.mean(decode_step_bytes(weights, kv, [prompt + i] * batch) for i in range(1, steps + 1))


def static_probe(ref: Any, args: argparse.Namespace) -> dict[str, float]:
    prompts = probe_prompts(args)
    elapsed = subtract_prefill(lambda new: static_generate(ref, prompts, new, args.device), args)
    return probe_figures(elapsed, args.probe[2], reference_step_bytes(ref, args), args.peak_tbs)


def continuous_generate(manager: Any, prompts: list[list[int]], max_tokens: list[int], tag: str) -> list[list[int]]:
    pairs = enumerate(zip(prompts, max_tokens, strict=True))
    ids = [manager.add_request(p, f"{tag}{i}", max_new_tokens=m) for i, (p, m) in pairs]
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            results[out.request_id] = list(out.generated_tokens)
    return [results[i] for i in ids]


def run_continuous(ref, prompts, max_tokens, args) -> dict[str, Any]:  # noqa: ANN001
    """transformers' continuous batching, per-request max_new_tokens; timed from the first request,
    after the manager's own warm-up (graph capture at its largest sizes) and a mini-workload."""
    gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None)
    cb_cfg = transformers.ContinuousBatchingConfig(max_memory_percent=0.5)  # NOTE: the rest stays for the others
    warm0 = time.perf_counter()
    with ref.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=5
    ) as manager:
        warm_prompts, warm_tokens = args.warmup
        continuous_generate(manager, warm_prompts, warm_tokens, "warm")
        warmup_s = time.perf_counter() - warm0
        with BusySampler(args.device) as busy:
            start, cpu = time.perf_counter(), time.process_time()
            tokens = continuous_generate(manager, prompts, max_tokens, "r")
            sync(args.device)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        figures = {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "warmup_s": warmup_s}
        figures |= {"dtype": model_dtype(ref, args), "peak_gib": peak_gib(args.device), **busy.figures()}
        if args.probe:
            batch, _, steps = args.probe
            few, runs = probe_prompts(args), itertools.count()  # NOTE: request ids unique across the runs
            elapsed = subtract_prefill(
                lambda new: continuous_generate(manager, few, [new] * batch, f"p{next(runs)}-"), args
            )
            figures |= probe_figures(elapsed, steps, reference_step_bytes(ref, args), args.peak_tbs)
    return figures


# --------------------------------------------------------------------------- the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument(
        "--shape", choices=(*SHAPES, *DECODERS), default=None, help=f"default: {GPU_SHAPE} on CUDA, 50m on CPU"
    )
    parser.add_argument("--prompts", type=int, default=None, help="default: 512 on CUDA, 128 on CPU")
    parser.add_argument("--prompt-lengths", default=None, help="LO,HI tokens (default: 16,1024 on CUDA, 16,256 on CPU)")
    parser.add_argument("--new-tokens", default=None, help="LO,HI max_tokens (default: 16,256 on CUDA, 16,128 on CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: 256 on CUDA, 128 on CPU")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 4096 on CUDA, 1024 on CPU")
    parser.add_argument("--kv-cache-memory", default=None, help="default: 0.5 of free memory on CUDA, 1GiB on CPU")
    parser.add_argument(
        "--variants",
        default=None,
        help="hpcinfer settings (default on CUDA: auto + decode graphs, triton and torch eager, FP8 weights, FP8 KV)",
    )
    parser.add_argument("--static-batches", default=None, help="default: 256 on CUDA, 8,16,32,64 on CPU")
    parser.add_argument(
        "--lead",
        type=int,
        default=None,
        help="hpcinfer variants run before transformers (default: 2 on CUDA, all on CPU)",
    )
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-cb", action="store_true")
    parser.add_argument(
        "--probe", default=None, help="B,P,K: the decode probe's sequences, prompt tokens, timed steps (0: none)"
    )
    parser.add_argument("--peak-tbs", type=float, default=H200_TBPS, help="the device's memory bandwidth, TB/s")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    add_deadline(parser)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    args.shape = args.shape or (GPU_SHAPE if cuda else "50m")
    args.dtype = ("bfloat16" if cuda else "float32") if args.dtype == "auto" else args.dtype
    args.torch_dtype = getattr(torch, args.dtype)
    args.prompts = args.prompts or (512 if cuda else 128)
    args.prompt_lengths = tuple(int(x) for x in (args.prompt_lengths or ("16,1024" if cuda else "16,256")).split(","))
    args.new_tokens = tuple(int(x) for x in (args.new_tokens or ("16,256" if cuda else "16,128")).split(","))
    args.max_num_seqs = args.max_num_seqs or (256 if cuda else 128)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (4096 if cuda else 1024)
    args.kv_cache_memory = parse_kv_memory(args.kv_cache_memory or ("0.5" if cuda else "1GiB"))
    # NOTE: the FP8 KV cache runs the torch path eagerly: in decode graphs that path gathers each
    # bucket's whole width (up to the longest context a sequence may reach), not the step's own
    default_variants = (
        "attention=auto,graphs=1;attention=triton,graphs=0;attention=torch,graphs=0;"
        "attention=auto,graphs=1,quantize=fp8;attention=torch,graphs=0,kv=fp8"
    )
    args.variants = parse_variants(args.variants or (default_variants if cuda else "attention=torch,graphs=0"))
    args.lead = args.lead if args.lead is not None else (2 if cuda else len(args.variants))
    args.static_batches = [int(x) for x in (args.static_batches or ("256" if cuda else "8,16,32,64")).split(",")]
    probe = [int(x) for x in (args.probe or ("64,512,64" if cuda else "8,64,8")).split(",")]
    args.probe = tuple(probe) if probe != [0] else None
    if args.probe is not None and len(args.probe) != 3:
        parser.error("--probe takes B,P,K (or 0)")
    return args


def build(args: argparse.Namespace, tmp: Path) -> Path:
    if args.shape in DECODERS:
        return build_decoder(tmp / args.shape, args.shape, args.dtype, str(args.device))
    return build_tiny_decoder(
        tmp / args.shape, max_positions=2048, initializer_range=0.05, seed=0, tokenizer_dir=TOKENIZER,
        dtype=args.dtype, init_device=str(args.device), **SHAPES[args.shape],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, deadline = args.device, Deadline(args.deadline)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    tmp = tempfile.TemporaryDirectory()
    path = build(args, Path(tmp.name))
    fresh_peak(device)
    info = inspect_decoder(path)
    model = load_decoder(info, device, args.torch_dtype)
    args.hf_config = read_config(path)
    args.vocab = info.config.vocab_size
    weights_gib = peak_gib(device)
    params = sum(p.numel() for p in model.parameters())
    prompts, max_tokens = workload(
        args.prompts, args.vocab, args.prompt_lengths, args.new_tokens, log=device.type == "cuda"
    )
    # NOTE: prefills longer than the step budget (continued chunks), decodes of several widths
    args.warmup = workload(16 if device.type == "cuda" else 4, args.vocab, args.prompt_lengths, (2, 8), seed=1)
    useful = sum(max_tokens)
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"model: random Llama, shape {args.shape}, {params / 1e6:.0f}M parameters, {args.dtype}, on {device}{gpu}")
    lengths = [len(p) for p in prompts]
    print(
        f"workload: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens (mean "
        f"{statistics.mean(lengths):.0f}), max_tokens {args.new_tokens[0]}-{args.new_tokens[1]}, "
        f"{useful} useful output tokens",
        flush=True,
    )
    summary = {
        "shape": args.shape,
        "parameters": params,
        "vocab_size": args.vocab,
        "dtype": args.dtype,
        "device": str(device) + gpu,
        "prompts": len(prompts),
        "prompt_tokens": sum(lengths),
        "useful_tokens": useful,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "probe": dict(zip(("sequences", "prompt_tokens", "steps"), args.probe, strict=True)) if args.probe else None,
        "peak_tbs": args.peak_tbs,
        "weights_peak_gib": weights_gib,
    }
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None

    def save() -> None:
        if args.json is not None:
            write_json(args.json, {"run": summary, "engines": rows})

    def measure(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        nonlocal reference
        row: dict[str, Any] = {"engine": name, "status": "running"}
        rows.append(row)
        save()
        fresh_peak(device)
        figures, failed = attempt(name, fn, deadline)
        if figures is None:
            row |= failed or {}
            save()
            return
        tokens = figures.pop("tokens")
        reference = tokens if reference is None else reference
        row |= {"status": "ok", **figures, "useful_tokens_per_s": useful / figures["wall_s"]}
        row["same_greedy_tokens"] = sum(a == b for a, b in zip(reference, tokens, strict=True))
        save()
        peak = f", peak {row['peak_gib']:.2f} GiB" if row.get("peak_gib") is not None else ""
        busy = f", busy {row['gpu_busy_share']:.0%}" if row.get("gpu_busy_share") is not None else ""
        decode = (
            f"; decode step {row['decode_step_ms']:.2f} ms, {row['decode_bandwidth_utilisation']:.0%} of "
            f"{args.peak_tbs} TB/s"
            if "decode_step_ms" in row
            else ""
        )
        print(
            f"{name}: {row['useful_tokens_per_s']:,.0f} useful tokens/s ({row['wall_s']:.2f} s, "
            f"{row['cpu_s']:.1f} CPU s{peak}{busy}{decode}), {row['same_greedy_tokens']}/{len(prompts)} "
            "token-identical to the first",
            flush=True,
        )

    save()

    models = {"hpcinfer": model}  # NOTE: cleared at the end: the weights are freed with it
    del model

    def hpcinfer_variant(variant: dict[str, Any]) -> None:
        name = variant_name(variant, variant["attention"])
        measure(name, lambda: run_hpcinfer(models["hpcinfer"], prompts, max_tokens, args, variant))
        row = rows[-1]
        if row["status"] == "ok":
            row["engine"] = variant_name(variant, row["attention"])  # what auto resolved to
            save()
            split = ", ".join(f"{k} {v:.0%}" for k, v in row["split"].items())
            print(
                f"  steps {row['steps']}, preemptions {row['preemptions']}, KV blocks {row['peak_kv_blocks']}"
                f"/{row['kv_blocks']}, graphs {row['graphs_captured']} captured / {row['graph_replays']} "
                f"replays, TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms; {split}"
            )

    # NOTE: the leading variants, then transformers, then the rest: what matters most is measured
    # before a deadline can cut the list short. One transformers model serves static batching, then
    # continuous batching (which may switch its attention implementation for good).
    lead = args.variants[: args.lead]
    for variant in lead:
        hpcinfer_variant(variant)
    holder: dict[str, Any] = {}

    def hf_model() -> Any:
        if "ref" not in holder:
            holder["ref"] = load_reference(path, args, attn_implementation="sdpa")
        return holder["ref"]

    for batch in [] if args.skip_static else args.static_batches:
        name = f"transformers generate, static batch {batch}"
        measure(name, lambda b=batch: run_static(hf_model(), prompts, max_tokens, b, args))
    if not args.skip_cb:
        measure("transformers continuous batching", lambda: run_continuous(hf_model(), prompts, max_tokens, args))
    holder.clear()
    for variant in args.variants[args.lead :]:
        hpcinfer_variant(variant)
    models.clear()
    tmp.cleanup()
    print_table(rows, len(prompts))
    if args.json is not None:
        print(f"figures written to {args.json}")
    failed = [r["engine"] for r in rows if r["status"] == "error"]
    if failed:
        print(f"engines that failed: {', '.join(failed)}")
    return 1 if failed or not any(r["status"] == "ok" for r in rows) else 0


def print_table(rows: list[dict[str, Any]], prompts: int) -> None:
    done = [r for r in rows if r["status"] == "ok"]
    hpc = [r for r in done if r["engine"].startswith("hpcinfer")]
    if not hpc:
        return
    best = max(r["useful_tokens_per_s"] for r in hpc)
    print("\n| engine | useful tokens/s | best hpcinfer is | same greedy tokens | decode BW use | busy | peak GiB |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['engine']} | {r['status']}: {r.get('error', r.get('reason', ''))[:60]} | | | | | |")
            continue
        bw = f"{r['decode_bandwidth_utilisation']:.0%}" if "decode_bandwidth_utilisation" in r else "-"
        busy = f"{r['gpu_busy_share']:.0%}" if r.get("gpu_busy_share") is not None else "-"
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        print(
            f"| {r['engine']} | {r['useful_tokens_per_s']:,.0f} | {best / r['useful_tokens_per_s']:.2f}x | "
            f"{r['same_greedy_tokens']}/{prompts} | {bw} | {busy} | {peak} |"
        )


if __name__ == "__main__":
    sys.exit(main())
