"""The native decoder families against `--backend transformers`, whole process, side by side in one run.

For each family (`--families`), a random checkpoint shaped like a small real model of that family
(its attention layout, MLP, norms, windows and RoPE; the MiniLM vocabulary, so the LM head is not
what is measured), built by the installed transformers, answers the same prompts (sample_data's
texts) greedily with a fixed number of new tokens (`--ignore-eos`) two ways:

- `hpcinfer run` with no backend flag: native (continuous batching over the paged KV cache);
- `hpcinfer run --backend transformers`: transformers' own model, in static batches.

Each is a fresh process timed from start to exit, so start-up counts as users pay it. The answers
are compared token for token (random weights give near-ties, so a few may part late).

    python benchmarks/speed/bench_decoders.py [--families gemma3,phi3,llama,qwen3_moe] [--prompts 128]
    python benchmarks/speed/bench_decoders.py --families gemma3,qwen3_moe --dtype bfloat16  # both sides
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line, timed_process  # noqa: E402

# family -> (transformers class, shape and family options). Gemma 3 270M's layout (640 hidden, 4
# heads of 256, 1 KV head, 2048 MLP, a 512-token window, 5 local layers per global one) with 12
# layers; Gemma 2 2B's head layout at a quarter of its width; Phi-3-mini's at a third; a Llama of
# the same size as the Gemma 3 one, and a Qwen3-MoE with that Llama's active parameters (the MoE
# against dense comparison: their native times, side by side).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": (
        "Gemma3ForCausalLM",
        {"hidden": 640, "layers": 12, "heads": 4, "kv_heads": 1, "intermediate": 2048, "head_dim": 256,
         "sliding_window": 512, "query_pre_attn_scalar": 256},
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        {"hidden": 576, "layers": 12, "heads": 8, "kv_heads": 4, "intermediate": 2304, "head_dim": 128,
         "sliding_window": 4096, "query_pre_attn_scalar": 128},
    ),
    "phi3": (
        "Phi3ForCausalLM",
        {"hidden": 1024, "layers": 10, "heads": 16, "kv_heads": 16, "intermediate": 2730},
    ),
    "llama": (
        "LlamaForCausalLM",
        {"hidden": 640, "layers": 12, "heads": 4, "kv_heads": 1, "intermediate": 2048, "head_dim": 160},
    ),
    # the Llama above with its MLP made 32 experts of 512, 4 per token: the same active parameters
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {"hidden": 640, "layers": 12, "heads": 4, "kv_heads": 1, "intermediate": 2048, "head_dim": 160,
         "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 512, "norm_topk_prob": True},
    ),
}  # fmt: skip


def build(folder: Path, family: str, **overrides: Any) -> Path:
    """A random checkpoint of `family`'s shape (options in `overrides` replacing the shape's)."""
    from tests.fixtures.tiny_decoder import build_tiny_decoder

    arch, shape = FAMILIES[family]
    options = {**shape, **overrides}
    return build_tiny_decoder(folder / family, arch, seed=0, max_positions=4096, initializer_range=0.02, **options)


def load_native(family: str, **overrides: Any) -> Any:
    """`build`'s checkpoint loaded by the native decoder, float32 on the CPU (the folder removed)."""
    import tempfile

    import torch

    from hpcinfer.models.decoder_checkpoint import load_decoder
    from hpcinfer.models.decoder_inspect import inspect_decoder

    with tempfile.TemporaryDirectory() as folder:
        info = inspect_decoder(build(Path(folder), family, **overrides))
        return load_decoder(info, torch.device("cpu"), torch.float32)


def prompts(path: Path, count: int) -> Path:
    texts = [json.loads(line)["text"] for line in (ROOT / "sample_data" / "requests.jsonl").open()]
    rows = [{"id": i, "prompt": " ".join(texts[i % len(texts)].split()[:48])} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def engine_seconds(model_dir: Path, prompts: int, new_tokens: int, dtype: str = "float32") -> float:
    """The native engine's time for the prompts alone, in this process (the model loaded first)."""
    import time

    import torch

    from hpcinfer.engine.engine import Engine, EngineConfig
    from hpcinfer.engine.sequence import SamplingParams
    from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer
    from hpcinfer.models.decoder_inspect import inspect_decoder

    info = inspect_decoder(model_dir)
    model = load_decoder(info, torch.device("cpu"), getattr(torch, dtype))
    tokenizer = load_tokenizer(info)
    texts = [json.loads(line)["text"] for line in (ROOT / "sample_data" / "requests.jsonl").open()]
    ids = [tokenizer.encode(" ".join(texts[i % len(texts)].split()[:48])).ids for i in range(prompts)]
    engine = Engine(model, EngineConfig(max_num_seqs=128, kv_cache_memory=1 << 30), info.eos_token_ids)
    engine.generate(ids[:4], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return time.perf_counter() - start


def answers(path: Path) -> dict[Any, str]:
    return {row["id"]: row["text"] for row in map(json.loads, path.open())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="gemma3,gemma2,phi3,llama,qwen3_moe")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides compute in it")
    args = parser.parse_args()
    print(cpu_line(os.cpu_count() or 1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rows = []
    engine_only: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        src = prompts(folder / "prompts.jsonl", args.prompts)
        for family in args.families.split(","):
            model = build(folder, family)
            times, outs = {}, {}
            for backend in ("native", "transformers"):
                out = folder / f"{family}-{backend}.jsonl"
                cmd = [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(out), "--model", str(model)]
                cmd += ["--max-tokens", str(args.new_tokens), "--ignore-eos", "--progress", "off", "--overwrite"]
                cmd += ["--dtype", args.dtype]
                if backend == "transformers":
                    cmd += ["--backend", "transformers"]
                times[backend], _ = timed_process(cmd, env=env)
                outs[backend] = answers(out)
            same = sum(outs["native"][k] == outs["transformers"].get(k) for k in outs["native"])
            if family in ("llama", "qwen3_moe"):
                engine_only[family] = engine_seconds(model, args.prompts, args.new_tokens, args.dtype)
            ratio = times["transformers"] / times["native"]
            rows.append((family, times["native"], times["transformers"], ratio, same))
            print(
                f"{family}: native {times['native']:.1f} s, --backend transformers {times['transformers']:.1f} s "
                f"({ratio:.2f}x), same answers {same}/{len(outs['native'])}",
                flush=True,
            )
    print(f"\n{args.prompts} prompts, {args.new_tokens} new tokens each, greedy, {args.dtype}, whole process:")
    print("| family | native | --backend transformers | native speed-up | same answers |")
    print("|---|---|---|---|---|")
    for family, native, hf, ratio, same in rows:
        print(f"| {family} | {native:.1f} s | {hf:.1f} s | {ratio:.2f}x | {same}/{args.prompts} |")
    native = {family: seconds for family, seconds, *_ in rows}
    if "qwen3_moe" in native and "llama" in native:
        moe = native["qwen3_moe"] / native["llama"]
        print(f"MoE against dense, same active parameters (native, whole process): {moe:.2f}x the time")
        steps = engine_only["qwen3_moe"] / engine_only["llama"]
        print(
            f"the same, the engine's steps alone (weights loaded): MoE {engine_only['qwen3_moe']:.1f} s, "
            f"dense {engine_only['llama']:.1f} s: {steps:.2f}x the time per token"
        )


if __name__ == "__main__":
    main()
