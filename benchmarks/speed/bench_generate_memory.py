"""Generation memory: peak RSS must stay flat as the number of prompts grows; the KV pool never grows.

Runs `hpcinfer run` (generation) in a fresh process over N short prompts of a tiny random Llama
checkpoint, for N = 2,000 and 10,000, and compares the processes' peak RSS and KV pool sizes.

    python benchmarks/speed/bench_generate_memory.py [--small 2000] [--large 10000]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from tests.fixtures.tiny_decoder import build_tiny_decoder  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "engineers", "measure"]


def run(model: Path, rows: int, tmp: Path) -> dict:
    rng = random.Random(rows)
    src = tmp / f"in-{rows}.jsonl"
    with open(src, "w", encoding="utf-8") as fh:
        for i in range(rows):
            fh.write(json.dumps({"id": i, "prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))}) + "\n")
    report = tmp / f"report-{rows}.json"
    code = (
        "import resource, sys; from hpcinfer.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    args = [str(src), "-o", str(tmp / f"out-{rows}.parquet"), "--model", str(model), "--max-tokens", "4"]
    args += ["--kv-cache-memory", "64MiB", "--threads", "1", "--progress", "off", "-q", "--report", str(report)]
    done = subprocess.run([sys.executable, "-c", code, "run", *args], capture_output=True, text=True, check=True)
    data = json.loads(report.read_text())
    return {
        "rows": data["rows"],
        "peak_rss_mib": int(done.stdout.split()[-1]) / 1024,
        "kv_cache_bytes": data["kv_cache_bytes"],
        "wall_s": data["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=10000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_decoder(Path(tmp) / "tiny", max_positions=128)
        small, large = run(model, args.small, Path(tmp)), run(model, args.large, Path(tmp))
    for r in (small, large):
        print(
            f"{r['rows']:>6} prompts: peak RSS {r['peak_rss_mib']:.0f} MiB, "
            f"KV pool {r['kv_cache_bytes'] / 2**20:.0f} MiB, {r['wall_s']:.1f} s"
        )
    growth = large["peak_rss_mib"] / small["peak_rss_mib"] - 1
    print(
        f"peak RSS growth {growth:+.1%} (limit +20%); "
        f"KV pool unchanged: {small['kv_cache_bytes'] == large['kv_cache_bytes']}"
    )


if __name__ == "__main__":
    main()
