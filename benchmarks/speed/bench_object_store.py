"""Inputs and outputs on S3 against the local disk: the same rows, the same run, side by side.

A real S3 API server (moto's standalone server, its own process, on 127.0.0.1) stands in for the
store; hpcinfer reaches it through s3fs with an endpoint override, as it would reach AWS. Each case
runs `hpcinfer run` as a process (start-up, listing and the final upload included), local and S3
alternating, `--repeats` times; the median wall times give the ratio (local / S3: 1.0 is as fast).

    python benchmarks/speed/bench_object_store.py [--rows 20000] [--model tiny|default] [--repeats 3]
        [--big-gb 1.0]  # then the peak memory of a run over a JSONL object this size, and of its local twin

`--model tiny` (a 2-layer, 32-wide random BERT) makes the run as I/O-bound as a run can be: the
store's share of the time is then at its largest. `default` is MiniLM, what users run.
Also measured: reading a Parquet object through fsspec's file (what hpcinfer uses) and through
pyarrow's own S3 filesystem, so the choice is a measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu, timed_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KEY, SECRET, REGION = "bench", "bench-secret", "us-east-1"


def texts(n: int) -> list[str]:
    lines = (ROOT / "sample_data" / "requests.jsonl").read_text().splitlines()
    return [json.loads(lines[i % len(lines)])["text"] for i in range(n)]


class S3Server:
    """moto's server in its own process, as a store is its own machine."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the moto server did not start") from None
                time.sleep(0.1)
        self.options = {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET,
                        "client_kwargs": {"region_name": REGION}}  # fmt: skip
        import s3fs

        self.fs = s3fs.S3FileSystem(use_listings_cache=False, **self.options)

    def cpu_s(self) -> float:
        """CPU seconds the server process has used: on a loopback store, taken from the run's cores."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def write_inputs(folder: Path, rows: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts(rows))]
    jsonl = folder / "in.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    parquet = folder / "in.parquet"
    pq.write_table(pa.Table.from_pylist(data), parquet, row_group_size=2048)
    return {"jsonl": jsonl, "parquet": parquet}


def hpcinfer(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcinfer", "run", *args, "--progress", "off", "-q", "--report-html", "off"]


def median_wall(
    server: S3Server, cmd_for: dict[str, list[str]], repeats: int, before: dict[str, object]
) -> tuple[dict[str, float], float]:
    """Median wall time of each command, run in turns (local, S3, local, S3, ...); and the median
    CPU seconds the store's server spent during the S3 runs."""
    walls: dict[str, list[float]] = {name: [] for name in cmd_for}
    store_cpu: list[float] = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for _ in range(repeats):
        for name, cmd in cmd_for.items():
            before[name]()  # type: ignore[operator]
            cpu = server.cpu_s()
            wall, _ = timed_process(cmd, env=env)
            walls[name].append(wall)
            if name == "s3":
                store_cpu.append(server.cpu_s() - cpu)
    return {name: statistics.median(w) for name, w in walls.items()}, statistics.median(store_cpu)


def throughput(server: S3Server, work: Path, model: str, rows: int, repeats: int) -> list[dict[str, object]]:
    files = write_inputs(work, rows)
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                 region_name=REGION).create_bucket(Bucket="bench")  # fmt: skip
    results = []
    for fmt, local_in in files.items():
        uri_in = f"s3://bench/in/{local_in.name}"
        server.fs.put_file(str(local_in), uri_in)
        local_out, uri_out = work / f"out-{fmt}.{fmt}", f"s3://bench/out/out.{fmt}"
        common = ["--model", model, "--storage-options", json.dumps(server.options), "--overwrite"]

        def clear_local(path: Path = local_out) -> None:
            path.unlink(missing_ok=True)

        def clear_s3(uri: str = uri_out) -> None:
            if server.fs.exists(uri):
                server.fs.rm_file(uri)

        walls, store_cpu = median_wall(
            server,
            {"local": hpcinfer(str(local_in), "-o", str(local_out), *common),
             "s3": hpcinfer(uri_in, "-o", uri_out, *common)},
            repeats,
            {"local": clear_local, "s3": clear_s3},
        )  # fmt: skip
        same = server.fs.cat_file(uri_out) == local_out.read_bytes()
        results.append({
            "format": fmt, "rows": rows, "local_s": round(walls["local"], 2), "s3_s": round(walls["s3"], 2),
            "local_rows_per_s": round(rows / walls["local"]), "s3_rows_per_s": round(rows / walls["s3"]),
            "s3_vs_local": round(walls["local"] / walls["s3"], 3), "outputs_identical": same,
            "store_server_cpu_s": round(store_cpu, 2),
        })  # fmt: skip
    return results


def parquet_read_paths(server: S3Server, rows: int) -> dict[str, float]:
    """Seconds to read the text column of the Parquet object: fsspec's file vs pyarrow's S3 filesystem."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    uri = "bench/in/in.parquet"
    timings = {}
    for _ in range(3):
        start = time.perf_counter()
        with server.fs.open(uri, "rb", block_size=8 << 20) as fh, pq.ParquetFile(fh) as f:
            n = sum(b.num_rows for b in f.iter_batches(batch_size=2048, columns=["text", "id"]))
        timings.setdefault("fsspec_s", []).append(time.perf_counter() - start)
        native = pafs.S3FileSystem(access_key=KEY, secret_key=SECRET, region=REGION,
                                   endpoint_override=server.endpoint, scheme="http")  # fmt: skip
        start = time.perf_counter()
        with pq.ParquetFile(native.open_input_file(uri)) as f:
            m = sum(b.num_rows for b in f.iter_batches(batch_size=2048, columns=["text", "id"]))
        timings.setdefault("pyarrow_s3_s", []).append(time.perf_counter() - start)
        assert n == m == rows
    return {k: round(min(v), 4) for k, v in timings.items()}


def peak_memory(server: S3Server, work: Path, model: str, gigabytes: float) -> dict[str, object]:
    """Peak RSS of a run over a JSONL object of `gigabytes`, and of the same run on the local file."""
    big = work / "big.jsonl"
    line_texts = texts(2000)
    target = int(gigabytes * 2**30)
    with open(big, "w", encoding="utf-8") as fh:
        i = 0
        while fh.tell() < target:
            fh.write(json.dumps({"id": f"b{i}", "text": line_texts[i % 2000] * 4}) + "\n")
            i += 1
    if not server.fs.exists("bench"):
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                     region_name=REGION).create_bucket(Bucket="bench")  # fmt: skip
    server.fs.put_file(str(big), "s3://bench/big/big.jsonl")
    rusage = ("import resource, sys, atexit; atexit.register(lambda: print('MAXRSS_KB', "
              "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); "
              "from hpcinfer.cli import main; sys.argv = ['hpcinfer'] + sys.argv[1:]; main()")  # fmt: skip
    out = {"input_bytes": big.stat().st_size, "rows": i}
    common = ["--model", model, "--storage-options", json.dumps(server.options), "--overwrite", "--progress", "off",
              "-q", "--report-html", "off"]  # fmt: skip
    for name, src, dst in (("s3", "s3://bench/big/big.jsonl", "s3://bench/big/out.parquet"),
                           ("local", str(big), str(work / "big-out.parquet"))):  # fmt: skip
        cmd = [sys.executable, "-c", rusage, "run", src, "-o", dst, *common]
        cpu = server.cpu_s()
        wall, done = timed_process(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if name == "s3":
            out["store_server_cpu_s"] = round(server.cpu_s() - cpu, 1)
        peak = int(done.stderr.split("MAXRSS_KB")[-1].split()[0]) * 1024
        out[f"{name}_peak_rss_mib"] = round(peak / 2**20)
        out[f"{name}_wall_s"] = round(wall, 1)
    big.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--model", default="tiny", help="tiny (a random 2-layer BERT), default (MiniLM) or a path")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big-gb", type=float, default=0.0, help="also the peak memory on a JSONL object this size")
    ap.add_argument("--memory-only", action="store_true", help="only the --big-gb peak memory")
    args = ap.parse_args()
    cpu = lscpu()
    flags = " ".join(f for f in cpu.get("Flags", "").split() if f.startswith(("avx", "amx")))
    print(f"cpu: {cpu.get('Model name')}, family {cpu.get('CPU family')} model {cpu.get('Model')}, "
          f"{os.cpu_count()} cores; flags: {flags}")  # fmt: skip
    server = S3Server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            model = args.model
            if model == "tiny":
                from tests.fixtures.tiny import build_tiny_bert

                model = str(build_tiny_bert(work / "tiny"))
            if not args.memory_only:
                for row in throughput(server, work, model, args.rows, args.repeats):
                    print(json.dumps(row), flush=True)
                print(json.dumps({"parquet_read": parquet_read_paths(server, args.rows)}), flush=True)
            if args.big_gb:
                print(json.dumps({"peak_memory": peak_memory(server, work, model, args.big_gb)}))
    finally:
        server.stop()
    print("# command:", shlex.join(sys.argv))


if __name__ == "__main__":
    main()
