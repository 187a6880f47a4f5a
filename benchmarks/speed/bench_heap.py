#!/usr/bin/env python
"""The C heap kept for reuse (hpcinfer/device/heap.py) against glibc's defaults, side by side.

The same `hpcinfer run` (the default model, the sample's first --rows rows, --threads threads)
runs --repeats times each way, a process per run, the two ways taking turns going first: the
heap kept (the default) and `HPCINFER_HEAP=system`. Each process's wall time, CPU (user and
system, from wait4), minor page faults and peak resident memory are printed, then the medians
and their ratios. The machine's
other work moves wall time between runs; the page faults and system time are what the setting
changes, so they are the figures to read first.

    python benchmarks/speed/bench_heap.py [--rows 1000] [--repeats 4] [--threads 2] [--model default]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line  # noqa: E402

MODES = {"kept": {}, "system": {"HPCINFER_HEAP": "system"}}


def one_run(src: Path, out: Path, log: Path, model: str, threads: int, env: dict[str, str]) -> dict[str, float]:
    """One `hpcinfer run` in its own process: wall seconds, wait4's CPU, faults and peak (MiB)."""
    cmd = [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(out), "--model", model,
           "--threads", str(threads), "--progress", "off", "-q", "--overwrite"]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k != "HPCINFER_HEAP"}  # NOTE: each mode sets its own
    start = time.perf_counter()
    with log.open("w") as err:  # NOTE: a file, not a pipe no one reads until the end
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                env={**environ, "HF_HUB_OFFLINE": "1", **env})  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text()[-2000:]}")
    return {"wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime, "faults": usage.ru_minflt,
            "peak_mib": usage.ru_maxrss / 1024}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    import pyarrow.parquet as pq

    print(f"{args.rows} rows of the sample, --model {args.model}, {cpu_line(args.threads)}", flush=True)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "rows.parquet"
        pq.write_table(pq.read_table(ROOT / "sample_data" / "requests.parquet").slice(0, args.rows), src)
        for repeat in range(args.repeats):
            order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))  # NOTE: each goes first in turn
            for mode in order:
                r = one_run(src, Path(tmp) / f"{mode}.parquet", Path(tmp) / "stderr.log", args.model, args.threads,
                            MODES[mode])  # fmt: skip
                runs[mode].append(r)
                print(f"  {repeat + 1} {mode:<7} {r['wall_s']:6.2f} s wall, {r['user_s']:6.2f} s user, "
                      f"{r['sys_s']:5.2f} s system, {r['faults']:>9,.0f} page faults, {r['peak_mib']:5.0f} MiB peak",
                      flush=True)  # fmt: skip
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"\nmedians of {args.repeats}:   {'kept':>10} {'system':>10}  system / kept")
    for key, label in (("wall_s", "wall s"), ("user_s", "user s"), ("sys_s", "system s"), ("faults", "page faults"),
                       ("peak_mib", "peak MiB")):  # fmt: skip
        kept, system = med["kept"][key], med["system"][key]
        print(f"  {label:<14} {kept:>10,.2f} {system:>10,.2f}  {system / kept:6.2f}x")
    cpu = {mode: med[mode]["user_s"] + med[mode]["sys_s"] for mode in med}
    print(
        f"  CPU (user + system): {cpu['kept']:.2f} s kept, {cpu['system']:.2f} s system: "
        f"{cpu['system'] / cpu['kept']:.2f}x"
    )


if __name__ == "__main__":
    main()
