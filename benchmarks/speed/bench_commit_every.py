#!/usr/bin/env python
"""What `kill -9` costs an embedding job, with --commit-every (the default 30 s) and without.

The job: 3,000 rows of about 200 words each (paragraphs made of sample_data/requests.jsonl's texts,
seeded), one window (the default --sort-window 100000), the default model (all-MiniLM-L6-v2), a
Parquet output. The steps, each `hpcinfer run` in a process of its own:

1. reference   the job uninterrupted (its wall time; its output is what every other must equal).
2. killed      the job with --commit-every (default 30), SIGKILL at --kill-at seconds (40) after it
               started; the manifest is watched meanwhile, so the rows kept and when the last
               checkpoint landed are known. Time lost: the seconds from the last checkpoint to the
               kill (work done and thrown away).
3. resumed     --resume on what the kill left: its wall time, rows taken back, and the output
               compared byte for byte with the reference.
4. off         (--with-off) the job with --commit-every off, killed at the same moment: the rows kept
               then (0 for a file under one window: what --commit-every fixes).

Fails (exit 1) when the killed run kept no row or the resumed output differs from the reference.

Usage (from the repository root):

    python benchmarks/speed/bench_commit_every.py [--rows 3000] [--words 200] [--kill-at 40] [--commit-every 30]
        [--with-off] [--json out.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import lscpu, timed_process  # noqa: E402

SAMPLE = REPO / "sample_data" / "requests.jsonl"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def make_input(path: Path, rows: int, words: int, seed: int = 0) -> None:
    """`rows` paragraphs of `words` +- 25% words, each from consecutive sample texts (seeded)."""
    texts = [json.loads(line)["text"] for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(rows):
            want, k, got = rng.randint(words * 3 // 4, words * 5 // 4), rng.randrange(len(texts)), []
            while len(got) < want:
                got += texts[k % len(texts)].split()
                k += 1
            fh.write(json.dumps({"id": f"p{i:05d}", "text": " ".join(got[:want])}) + "\n")


def hpcinfer(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcinfer", "run", *args]


def kept(out: Path) -> tuple[int, int]:
    """(rows in committed windows, rows in checkpoints) the output's manifest lists now."""
    try:
        data = json.loads((Path(f"{out}.parts") / "manifest.json").read_text())
    except (OSError, ValueError):
        return 0, 0
    return sum(w["rows"] for w in data.get("windows", [])), sum(p["rows"] for p in data.get("partial", []))


def killed_run(args: list[str], out: Path, kill_at: float) -> dict[str, Any]:
    """Runs the job, SIGKILLs it `kill_at` seconds in, watching what its manifest keeps meanwhile."""
    proc = subprocess.Popen(hpcinfer(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    t0 = time.monotonic()
    commits: list[tuple[float, int]] = []  # (seconds in, rows kept) whenever that changed
    while (now := time.monotonic() - t0) < kill_at and proc.poll() is None:
        rows = sum(kept(out))
        if rows != (commits[-1][1] if commits else 0):
            commits.append((round(now, 2), rows))
        time.sleep(0.05)
    if proc.poll() is not None:
        raise SystemExit(f"the run ended after {now:.1f} s, before the kill at {kill_at} s: give it more rows")
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic() - t0
    proc.communicate(timeout=60)
    windows, checkpoints = kept(out)
    if windows + checkpoints != (commits[-1][1] if commits else 0):
        commits.append((round(killed_at, 2), windows + checkpoints))  # landed between the last look and the kill
    last = commits[-1][0] if commits else 0.0
    return {
        "killed_at_s": round(killed_at, 2),
        "rows_in_windows": windows,
        "rows_in_checkpoints": checkpoints,
        "rows_kept": windows + checkpoints,
        "commits": commits,
        "last_commit_s": last,
        "time_lost_s": round(killed_at - last, 2),  # work done after the last commit (from the start, with none)
    }


def cpu_name() -> str:
    """lscpu's model name, family and model, and the cores this process may use."""
    fields = lscpu()
    name, family, model = fields.get("Model name", ""), fields.get("CPU family", ""), fields.get("Model", "")
    return f"{name} (family {family} model {model}), {len(os.sched_getaffinity(0))} cores"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--words", type=int, default=200)
    ap.add_argument("--kill-at", type=float, default=40.0)
    ap.add_argument("--commit-every", default="30")
    ap.add_argument("--with-off", action="store_true", help="also kill a run with --commit-every off")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", help="work in this directory (kept) instead of a temporary one")
    opts = ap.parse_args()

    work = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="hpcinfer-commit-every-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "paragraphs.jsonl"
    make_input(src, opts.rows, opts.words)
    common = [str(src), "--progress", "off", "-q"]
    figures: dict[str, Any] = {"cpu": cpu_name(), "rows": opts.rows, "words": opts.words, "kill_at_s": opts.kill_at}
    print(f"{opts.rows:,} rows of ~{opts.words} words, default model, on {figures['cpu']}", flush=True)

    reference = work / "reference.parquet"
    wall, _ = timed_process(hpcinfer(*common, "-o", str(reference), "--overwrite", "--commit-every", "off"), ENV)
    figures["reference_wall_s"] = round(wall, 2)
    print(f"reference: {wall:.1f} s uninterrupted", flush=True)

    out = work / "killed.parquet"
    every = ["--commit-every", opts.commit_every]
    for stale in (out, Path(f"{out}.parts")):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    killed = killed_run([*common, *every, "-o", str(out)], out, opts.kill_at)
    figures["killed"] = killed
    print(
        f"killed at {killed['killed_at_s']:.1f} s (--commit-every {opts.commit_every}): "
        f"{killed['rows_kept']:,} rows kept ({killed['rows_in_windows']:,} in windows, "
        f"{killed['rows_in_checkpoints']:,} in checkpoints); commits at {killed['commits']}; "
        f"time lost {killed['time_lost_s']:.1f} s",
        flush=True,
    )

    report = work / "resumed.json"
    wall, _ = timed_process(hpcinfer(*common, *every, "-o", str(out), "--resume", "--report", str(report)), ENV)
    resumed = json.loads(report.read_text())
    identical = out.read_bytes() == reference.read_bytes()
    figures["resumed"] = {
        "wall_s": round(wall, 2),
        "rows_resumed": resumed["rows_resumed"],
        "batches": resumed["batches"],
        "identical_to_reference": identical,
    }
    print(
        f"resumed: {wall:.1f} s, {resumed['rows_resumed']:,} rows taken back, output "
        f"{'byte-identical to' if identical else 'DIFFERENT FROM'} the reference",
        flush=True,
    )

    if opts.with_off:
        off = work / "off.parquet"
        for stale in (off, Path(f"{off}.parts")):
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        figures["off"] = killed_run([*common, "--commit-every", "off", "-o", str(off)], off, opts.kill_at)
        print(f"--commit-every off, killed at {figures['off']['killed_at_s']:.1f} s: "
              f"{figures['off']['rows_kept']:,} rows kept", flush=True)  # fmt: skip

    if opts.json:
        Path(opts.json).write_text(json.dumps(figures, indent=2) + "\n")
    ok = killed["rows_kept"] > 0 and identical
    print("PASS" if ok else "FAIL: no row was kept, or the resumed output differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
