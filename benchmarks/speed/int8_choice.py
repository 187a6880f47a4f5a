#!/usr/bin/env python
"""Which int8 kernel a run takes, and what it costs: float32, `--quantize int8` and `--quantize auto`
on the default embedder, whole process each, on held-out rows.

    python benchmarks/speed/int8_choice.py [--rows 500] [--repeats 2] [--isa AVX2]

The rows are the last --rows of sample_data/requests.jsonl (the calibration and the report's
cosine use the job's first 320, so most rows are held out from both). Each method runs as one
process per round, the methods taking turns; the best round counts. Printed per method: seconds,
rows/s, speed over float32, the kernel the run chose and its check on 256 held-out rows (`--report`),
and the cosine of every row to float32's output (min and mean).

`--isa AVX2` runs every process with ONEDNN_MAX_CPU_ISA=AVX2: oneDNN as an AVX2-only CPU runs it
(pairs of products summed in 16 bits), to show the probe keeping its saturating 8-bit kernel out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import timed_process  # noqa: E402

METHODS = {"float32": [], "int8": ["--quantize", "int8"], "auto": ["--quantize", "auto"]}


def embeddings(path: Path) -> np.ndarray:
    return np.stack(pq.read_table(path).column("embedding").to_numpy(zero_copy_only=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--isa", help="ONEDNN_MAX_CPU_ISA for every process (AVX2: oneDNN as an AVX2-only CPU runs)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.isa:
        env["ONEDNN_MAX_CPU_ISA"] = args.isa
    lines = (REPO_ROOT / "sample_data" / "requests.jsonl").read_text().splitlines()[-args.rows :]
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.jsonl"
        rows.write_text("\n".join(lines) + "\n")
        best = dict.fromkeys(METHODS, float("inf"))
        for r in range(args.repeats):
            for name, flags in METHODS.items():
                out, report = Path(tmp) / f"{name}.parquet", Path(tmp) / f"{name}.json"
                cmd = [sys.executable, "-m", "hpcinfer", "run", str(rows), "-o", str(out), "--overwrite", "-q"]
                cmd += ["--progress", "off", "--report", str(report), *flags]
                wall, done = timed_process(cmd, env, check=False)  # NOTE: a refusal is a figure too
                if done.returncode != 0:
                    figures[name] = {"error": done.stderr.strip().splitlines()[-1:]}
                    print(f"round {r} {name}: refused: {done.stderr.strip()[-400:]}", flush=True)
                    continue
                best[name] = min(best[name], wall)
                figures[name] = {"quantize": json.loads(report.read_text()).get("quantize", {})}
                print(f"round {r} {name}: {wall:.2f} s", flush=True)
        reference = embeddings(Path(tmp) / "float32.parquet")
        for name in METHODS:
            path = Path(tmp) / f"{name}.parquet"
            if "error" in figures.get(name, {}) or not path.exists():
                continue
            ours = embeddings(path)
            cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
            figures[name].update(
                seconds=round(best[name], 2),
                rows_per_s=round(args.rows / best[name], 1),
                speed_vs_float32=round(best["float32"] / best[name], 2),
                min_cosine=round(float(cosine.min()), 4),
                mean_cosine=round(float(cosine.mean()), 4),
            )
    print(f"\n{args.rows} rows{' (ONEDNN_MAX_CPU_ISA=' + args.isa + ')' if args.isa else ''}, best of {args.repeats}")
    for name, f in figures.items():
        if "error" in f:
            print(f"{name:8s} refused: {f['error']}")
            continue
        q = f["quantize"]
        chose = f"{q.get('chosen')} on {q.get('engine')}, check min cosine {q.get('min_cosine')}" if q else "-"
        print(
            f"{name:8s} {f['seconds']:7.2f} s {f['rows_per_s']:7.1f} rows/s {f['speed_vs_float32']:5.2f}x  "
            f"min cosine {f['min_cosine']:.4f} mean {f['mean_cosine']:.4f}  [{chose}]"
        )
        if q.get("reason"):
            print(f"{'':8s} auto: {q['reason']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
