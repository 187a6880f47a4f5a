#!/usr/bin/env python
"""Peak memory of the ragged outputs against dense embeddings of the same encoder, in one run.

Each kind runs `hpcinfer run` in a process of its own (its peak RSS is the kernel's, from wait4)
on the same --rows rows of --tokens tokens each (long texts, truncated to the model's length), on
a MiniLM-shaped BERT (hidden 384, 6 layers, 12 heads) whose max_seq_length is --tokens:

1. dense             --task embed                                 (the baseline)
2. sparse (SPLADE)   --task sparse on the same encoder with BERT's masked-LM head (30,522 words),
                     its decoder bias set so a row keeps about --sparse-active entries
3. token embeddings  --task embed --output-value token_embeddings (a 384-float vector per token)

A dense vocabulary row per input row (what SPLADE held before its rows became ragged items) is
30,522 floats: 244 MB for 2,000 rows; a token-embedding row padded to 512 tokens is 786 KB.
The script prints each kind's peak RSS, its ratio to dense, rows/s and output bytes per row.

    python benchmarks/speed/bench_ragged_memory.py [--rows 2000] [--tokens 512] [--threads 2]
    python benchmarks/speed/bench_ragged_memory.py --kinds dense,sparse   # SPLADE against dense only

On 2 cores, 2,000 rows of 512 tokens: about 8 minutes for dense and SPLADE; token embeddings add
more (1.5 GB of output to encode and write).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import lscpu  # noqa: E402

WORDS = ["river", "stone", "market", "quiet", "engine", "paper", "winter", "garden", "signal", "harbor", "pencil",
         "orbit", "lantern", "copper", "meadow", "thunder", "violet", "canyon", "mirror", "ladder"]  # fmt: skip


def long_texts(rows: int, words: int) -> list[str]:
    """`rows` texts of `words` words each (every one longer than the model's tokens, so truncated)."""
    return [" ".join(WORDS[(r * 7 + i * 3) % len(WORDS)] for i in range(words)) for r in range(rows)]


def build_models(folder: Path, tokens: int, sample: list[str], active: int) -> dict[str, Path]:
    from benchmarks.speed import bench_retrieval_outputs as retrieval
    from hpcinfer.models.registry import resolve_model_path
    from tests.fixtures.tiny import MINILM_L6_SHAPE, build_tiny_bert

    shape = {**MINILM_L6_SHAPE, "max_positions": max(512, tokens), "max_seq_length": tokens}
    dense = build_tiny_bert(folder / "dense", **shape, tokenizer_dir=resolve_model_path("default"), scale=0.02)
    retrieval.MAX_SEQ_LENGTH = tokens  # NOTE: the SPLADE checkpoint truncates where the dense one does
    splade = retrieval.build_splade(folder, sample, active)
    return {"dense": dense, "sparse (SPLADE)": splade, "token embeddings": dense}


KINDS = {
    "dense": ["--task", "embed"],
    "sparse (SPLADE)": ["--task", "sparse"],
    "token embeddings": ["--task", "embed", "--output-value", "token_embeddings"],
}


def high_water_mb(pid: int) -> float | None:
    """The process's peak resident memory so far (VmHWM), or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) / 1024 if line else None


def run_kind(corpus: Path, out: Path, model: Path, flags: list[str], threads: int) -> dict[str, float]:
    """One `hpcinfer run` in its own process: its peak RSS (MB), wall seconds and output bytes.

    NOTE: the peak is the child's VmHWM, read every 20 ms until it exits (a high-water mark never
    falls): wait4's ru_maxrss would count this process's memory, which a forked child starts with."""
    cmd = [sys.executable, "-m", "hpcinfer", "run", str(corpus), "-o", str(out), "--model", str(model),
           "--threads", str(threads), "--progress", "off", "-q", "--overwrite", *flags]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    peak = 0.0
    while proc.poll() is None:
        seen = high_water_mb(proc.pid)
        peak = max(peak, seen or 0.0)
        time.sleep(0.02)
    wall = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return {"peak_mb": peak, "wall_s": wall, "bytes": out.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per row (the models' max_seq_length)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparse-active", type=int, default=200, help="entries a sparse row keeps, about")
    ap.add_argument("--target", type=float, default=1.2, help="the most SPLADE's peak may be, as a multiple of dense's")
    ap.add_argument("--kinds", default="dense,sparse,token", help="which kinds, by first word (dense always runs)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    wanted = {"dense", *(k.strip().lower() for k in args.kinds.split(",") if k.strip())}
    kinds = {kind: flags for kind, flags in KINDS.items() if kind.split()[0] in wanted}
    if len(kinds) < len(wanted):
        ap.error(f"--kinds: each one of {', '.join(k.split()[0] for k in KINDS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpu = lscpu().get("Model name", "unknown CPU")
    print(f"{args.rows} rows of {args.tokens} tokens, {args.threads} threads, a process per kind, {cpu}", flush=True)
    texts = long_texts(args.rows, args.tokens)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        corpus = folder / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
        models = build_models(folder, args.tokens, texts[:32], args.sparse_active)
        for kind, flags in kinds.items():
            results[kind] = run_kind(corpus, folder / f"{len(results)}.parquet", models[kind], flags, args.threads)
            print(f"  {kind}: {results[kind]['peak_mb']:.0f} MB peak, {results[kind]['wall_s']:.1f} s", flush=True)
    base = results["dense"]
    print(f"{'kind':<18}{'peak MB':>9}{'x dense':>9}{'rows/s':>9}{'x dense':>9}{'B/row':>11}")
    for kind, r in results.items():
        print(f"{kind:<18}{r['peak_mb']:>9.0f}{r['peak_mb'] / base['peak_mb']:>9.2f}{args.rows / r['wall_s']:>9.1f}"
              f"{base['wall_s'] / r['wall_s']:>9.2f}{r['bytes'] / args.rows:>11.0f}")  # fmt: skip
    if "sparse (SPLADE)" in results:
        sparse = results["sparse (SPLADE)"]["peak_mb"] / base["peak_mb"]
        verdict = "within" if sparse <= args.target else "above"
        print(f"SPLADE's peak is {sparse:.2f}x dense's: {verdict} the {args.target}x target")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "rows": args.rows, "tokens": args.tokens, "results": results},
                                        indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
