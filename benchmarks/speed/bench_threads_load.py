"""Generation's thread count on a busy machine: the default against --threads 1 and --threads 2.

Runs the README's SmolLM2 chats (`hpcinfer run sample_data/chats.jsonl --model smollm2`) as whole
processes, the settings taking turns within each round, first beside `--load` busy processes
(pure-Python spinning loops this script starts and stops), then on the quiet machine. Prints each
run's wall time, the threads the default settled on (the report's `threads`), whether the answers
are the same bytes as the first run's, and the default's time over the best setting's in each phase.

    python benchmarks/speed/bench_threads_load.py [--rows 100] [--rounds 1] [--load 2]

Target: the default within 1.2x of the best setting, loaded and quiet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import timed_process  # noqa: E402

SPIN = "import time\nend = time.time() + {limit}\nwhile time.time() < end:\n    pass\n"


@contextmanager
def busy(processes: int, limit_s: float):
    """`processes` spinning Python processes for the block (each ends by itself after `limit_s`)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(limit=limit_s)]) for _ in range(processes)]
    try:
        time.sleep(0.5)  # NOTE: running before the measured process starts
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_once(chats: Path, out_dir: Path, threads: str, tag: str) -> dict:
    out, report = out_dir / f"{tag}.jsonl", out_dir / f"{tag}.report.json"
    cmd = [sys.executable, "-m", "hpcinfer", "run", str(chats), "-o", str(out), "--model", "smollm2", "-q"]
    cmd += ["--report", str(report)] + (["--threads", threads] if threads != "default" else [])
    wall, done = timed_process(cmd)
    facts = json.loads(report.read_text())
    return {
        "wall_s": round(wall, 2),
        "run_s": round(facts.get("wall_s", 0.0), 2),
        "threads": facts.get("threads", {}),
        "sha": hashlib.sha256(out.read_bytes()).hexdigest()[:12],
        "note": [line for line in done.stderr.splitlines() if "threads:" in line],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100, help="the first N chats of sample_data/chats.jsonl")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--load", type=int, default=2, help="busy processes in the loaded phase")
    parser.add_argument("--settings", default="default,1,2", help="comma-separated: default and --threads values")
    parser.add_argument("--phases", default="loaded,quiet")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    settings = args.settings.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        chats = tmp_dir / "chats.jsonl"
        lines = (ROOT / "sample_data" / "chats.jsonl").read_text().splitlines()[: args.rows]
        chats.write_text("\n".join(lines) + "\n")
        results: dict[str, dict[str, list[dict]]] = {}
        for phase in args.phases.split(","):
            results[phase] = {s: [] for s in settings}
            load = args.load if phase == "loaded" else 0
            with busy(load, limit_s=3600) if load else _nothing():
                for r in range(args.rounds):
                    for i, setting in enumerate(settings[r % len(settings) :] + settings[: r % len(settings)]):
                        figures = run_once(chats, tmp_dir, setting, f"{phase}-{setting}-{r}-{i}")
                        results[phase][setting].append(figures)
                        print(
                            f"{phase:7s} round {r} threads={setting:8s} {figures['wall_s']:8.1f} s "
                            f"(run {figures['run_s']:.1f} s) answers {figures['sha']} "
                            f"threads {figures['threads'].get('threads_start')}->"
                            f"{figures['threads'].get('threads_end')}",
                            flush=True,
                        )
    print()
    for phase, by_setting in results.items():
        best = {s: min(f["wall_s"] for f in runs) for s, runs in by_setting.items()}
        fastest = min(best.values())
        line = ", ".join(f"{s} {t:.1f} s ({t / fastest:.2f}x)" for s, t in best.items())
        print(f"{phase}: {line}; default / best = {best.get('default', fastest) / fastest:.2f}x (target <= 1.2x)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


@contextmanager
def _nothing():
    yield


if __name__ == "__main__":
    main()
