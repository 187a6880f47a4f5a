"""The multi-device step of gpu_check.sh: every visible GPU at once, against one GPU.

Runs the sample through `--devices all` (one replica per visible GPU; `--dry-run`: `cpu,cpu`)
and through one device, checks the outputs agree (ids equal, embeddings to 1e-3 in half
precision), prints the per-device table (token share, busy share, idle tail), and checks that one
GPU listed twice (`--devices cuda:0,cuda:0`) is refused with a clear error.

Then a short generation run on a tiny random decoder built on the spot (`--gen-rows` prompts,
greedy, float32, 32 tokens each, 16 on the CPU): every visible GPU against one, the same tokens
row for row, and the per-device table (rows, completion tokens, busy share, idle tail). On the
CPU (`--dry-run`) every row must be equal; on GPUs 95% of them (a batch of another shape may take
another kernel, and a near tie of two logits can then go the other way).

With fewer than 2 GPUs visible it prints 'skipped' and succeeds at once.

    python benchmarks/gpu_check/multi_device_check.py --model DIR [--dry-run] [--rows N] [--gen-rows N] [--deadline S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data" / "requests.jsonl"
TOKENIZER = Path(__file__).resolve().parents[1] / "minilm_tokenizer"
KV_CACHE = "256MiB"  # the generation check's KV pool, the same on every device


def hpcinfer(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "hpcinfer", "run", *args], capture_output=True, text=True, env=env)


def generation_check(tmp: Path, many: str, one: str, rows: int, exact: bool) -> bool:
    """--devices MANY against one device on a tiny decoder: the same greedy answers, row for row.

    NOTE: in this process (torch imported once) rather than two more CLI runs, to keep the step short.
    """
    from hpcinfer.api import run
    from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not
    from tests.fixtures.tiny_decoder import build_tiny_decoder

    # NOTE: the tokenizer shipped beside this script: the GPU machine has no packaged model
    model = build_tiny_decoder(tmp / "decoder", "LlamaForCausalLM", seed=3, max_positions=256, tokenizer_dir=TOKENIZER)
    src = tmp / "prompts.jsonl"
    with open(SAMPLE, encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for _, line in zip(range(rows), fh, strict=False)]
    src.write_text("".join(json.dumps({"id": i, "prompt": t[:400]}) + "\n" for i, t in enumerate(texts)))
    got = {}
    for spec in (one, many):
        out = tmp / f"gen_{spec.replace(',', '_')}.jsonl"
        # NOTE: on the CPU one thread per engine: OpenMP threads on shared cores only wait for each other
        device = DeviceConfig(device=spec, dtype="float32", threads=1 if exact else None)
        config = RunConfig(
            input=InputConfig((str(src),)),
            model=str(model),
            output=OutputConfig(str(out)),
            pipeline=PipelineConfig(progress="off"),
            device=device if spec == one else replace(device, device="auto", devices=spec),
            # NOTE: an explicit pool: the default (0.85 of free memory) would zero a GPU's worth of
            # KV for a model of a few MB, and a second run in this process would size it otherwise.
            generate=GenerateConfig(max_tokens=16 if exact else 32, kv_cache_memory=KV_CACHE),
        )
        try:
            report = run(config).to_dict()
        except Exception as exc:
            print(f"generation on {spec} failed: {type(exc).__name__}: {exc}")
            return False
        got[spec] = ([json.loads(x) for x in out.read_text().splitlines()], report)
    (a, ra), (b, rb) = got[one], got[many]
    same = sum(x == y for x, y in zip(a, b, strict=False))
    print(
        f"generation, one device ({one}): {ra['completion_tokens_per_s']:,.1f} tokens/s; "
        f"--devices {many}: {rb['completion_tokens_per_s']:,.1f} tokens/s"
    )
    for d in rb["devices"]:
        print(
            f"  {d['device']:<10} rows {d['rows']:>5}  tokens {d['completion_tokens']:>7,} ({d['token_share']:6.1%})  "
            f"busy share {d['busy_share']:6.1%}  idle tail {d['idle_tail_s']:.3f} s"
        )
    total = sum(d["completion_tokens"] for d in rb["devices"])
    print(f"same answers: {same}/{len(a)} rows; per-device tokens add up: {total == rb['completion_tokens']}")
    enough = same == rows if exact else same >= 0.95 * rows
    return len(a) == len(b) == rows and enough and total == rb["completion_tokens"]


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--gen-rows", type=int, default=256, help="prompts of the generation check")
    p.add_argument("--dry-run", action="store_true", help="two CPU replicas instead of every GPU")
    p.add_argument("--deadline", type=float, default=None, metavar="S", help="skip the generation check past S s")
    args = p.parse_args(argv)
    many, one = ("cpu,cpu", "cpu") if args.dry_run else ("all", "cuda:0")
    if not args.dry_run and visible_gpus() < 2:
        # NOTE: --devices all would be cuda:0 alone: a minute spent measuring nothing
        print(f"skipped: {visible_gpus()} GPU visible (--devices all is cuda:0 alone; nothing multi-device to measure)")
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        with open(SAMPLE, encoding="utf-8") as fh:
            src.write_text("".join(line for _, line in zip(range(args.rows), fh, strict=False)))
        common = [str(src), "--model", args.model, "--progress", "off", "-q"]
        outs = {}
        for spec in (one, many):
            out, report = Path(tmp) / f"{spec.replace(',', '_')}.parquet", Path(tmp) / f"{spec}.json"
            flag = ["--device", spec] if spec == one else ["--devices", spec]
            done = hpcinfer(*common, "-o", str(out), *flag, "--report", str(report))
            if done.returncode != 0:
                print(f"--devices {spec} failed:\n{done.stderr}")
                return 1
            outs[spec] = (pq.read_table(out), json.loads(report.read_text()))
        (a, ra), (b, rb) = outs[one], outs[many]
        same_ids = a.column("id").to_pylist() == b.column("id").to_pylist()
        ea = np.asarray(a.column("embedding").to_pylist(), dtype=np.float32)
        eb = np.asarray(b.column("embedding").to_pylist(), dtype=np.float32)
        diff = float(np.abs(ea - eb).max()) if len(ea) else 0.0
        print(f"one device ({one}): {ra['rows_per_s']:,.1f} rows/s; --devices {many}: {rb['rows_per_s']:,.1f} rows/s")
        for d in rb["devices"]:
            print(
                f"  {d['device']:<10} batches {d['batches']:>5}  token share {d['token_share']:6.1%}  "
                f"busy share {d['busy_share']:6.1%}  idle tail {d['idle_tail_s']:.3f} s"
            )
        print(f"ids equal: {same_ids}; max |embedding difference|: {diff:.2e}")
        refused = hpcinfer(*common, "-o", str(Path(tmp) / "twice.parquet"), "--devices", "cuda:0,cuda:0")
        clear = refused.returncode == 2 and "listed 2 times" in refused.stderr and "Traceback" not in refused.stderr
        print(f"--devices cuda:0,cuda:0 refused clearly: {clear} ({refused.stderr.strip()})")
        if args.deadline is not None and time.monotonic() - started > args.deadline:
            print("generation check skipped: past the --deadline")
            return 1
        generated = generation_check(Path(tmp), many, one, args.gen_rows, exact=args.dry_run)
        return 0 if same_ids and diff <= 1e-3 and clear and generated else 1


if __name__ == "__main__":
    sys.exit(main())
