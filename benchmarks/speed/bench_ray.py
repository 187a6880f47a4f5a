"""The overhead of Ray on one machine: `--engine ray` with 1 and 2 replicas against the local engine.

Runs the same job (the sample file, the default model, the same --sort-window for every engine so
the windows, hence the batches, are the same) through the local engine and through a local Ray
instance started once beforehand (as a cluster would be running already), and prints rows/s and
the ratio to the local engine. Two figures per run: `job rows/s` is the end-to-end time of the
run call (model loading, Ray actors starting, assembly: what a user waits for); `engine rows/s`
is the report's own (from the first row read to the last committed). It also checks that every
engine wrote the same embeddings.

    python benchmarks/speed/bench_ray.py                     # 3,000 rows of sample_data/requests.parquet
    python benchmarks/speed/bench_ray.py --sort-window 500 --repeats 2 --num-cpus 2

`--generate` compares generation instead: a tiny random decoder (built in a temporary directory)
answers the first `--rows` texts of the sample file (cut to `--prompt-words` words) with
`--max-tokens` greedy tokens each, locally and with `--engine ray` and 1 replica; it prints
generated tokens/s of the job and of the engine (the report's) and the ratio to the local engine,
and checks that both wrote the same answers.

    python benchmarks/speed/bench_ray.py --generate --rows 256 --max-tokens 32 --window-rows 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from hpcinfer.api import run
from hpcinfer.config import (
    ClusterConfig,
    DeviceConfig,
    GenerateConfig,
    InputConfig,
    OutputConfig,
    PipelineConfig,
    PlanConfig,
    RunConfig,
)
from hpcinfer.obs.progress import Progress

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data" / "requests.parquet"


def job(path: str, out: Path, model: str, window: int, engine: str = "local", replicas: int | None = None) -> RunConfig:
    return RunConfig(
        input=InputConfig((path,)),
        model=model,
        plan=PlanConfig(sort_window=window),
        output=OutputConfig(str(out), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
        cluster=ClusterConfig(engine, replicas=replicas),
    )


def timed(config: RunConfig) -> tuple[float, float, int, np.ndarray]:
    start = time.perf_counter()
    report = run(config, progress=Progress("off"))
    wall = time.perf_counter() - start
    values = np.array(pq.read_table(config.output.path, columns=["embedding"]).column(0).to_pylist(), np.float32)
    return report.rows / wall, report.rows_per_s, report.rows, values


def generation_job(path: str, out: Path, model: str, args: argparse.Namespace, engine: str = "local") -> RunConfig:
    return RunConfig(
        input=InputConfig((path,)),
        model=model,
        output=OutputConfig(str(out), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(device="cpu", threads=args.threads or args.num_cpus),
        generate=GenerateConfig(max_tokens=args.max_tokens, window_rows=args.window_rows, ignore_eos=True),
        cluster=ClusterConfig(engine, replicas=1 if engine == "ray" else None),
    )


def compare_generation(args: argparse.Namespace) -> None:
    """Local vs `--engine ray` x1 generation on a tiny decoder; the ray instance is already up."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not
    from tests.fixtures.tiny_decoder import build_tiny_decoder

    texts = pq.read_table(args.input, columns=["text"]).column("text").to_pylist()[: args.rows]
    best: dict[str, tuple[float, float]] = {}
    answers: dict[str, str] = {}
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_decoder(Path(tmp) / "decoder", "Qwen2ForCausalLM", hidden=args.hidden, layers=4, seed=1)
        src = Path(tmp) / "prompts.jsonl"
        rows = ({"id": i, "prompt": " ".join(t.split()[: args.prompt_words])} for i, t in enumerate(texts))
        src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        for round_ in range(args.repeats):
            # NOTE: the order alternates: Ray's own processes still busy the cores just after it starts.
            for engine in ("local", "ray") if round_ % 2 else ("ray", "local"):
                out = Path(tmp) / f"{engine}.jsonl"
                start = time.perf_counter()
                report = run(generation_job(str(src), out, str(model), args, engine), progress=Progress("off"))
                wall = time.perf_counter() - start
                tokens = report.completion_tokens
                job_tps, engine_tps = tokens / wall, report.completion_tokens_per_s
                print(f"round {round_ + 1} {engine:6s} job {job_tps:9.1f} tok/s  engine {engine_tps:9.1f} tok/s")
                prev = best.get(engine, (0.0, 0.0))
                best[engine] = (max(prev[0], job_tps), max(prev[1], engine_tps))
                answers[engine] = out.read_text(encoding="utf-8")
    same = answers["ray"] == answers["local"]
    print(f"\n{len(texts):,} prompts x {args.max_tokens} tokens ({tokens:,} generated), tiny decoder")
    threads = args.threads or args.num_cpus
    print(f"hidden {args.hidden}, --window-rows {args.window_rows}, --threads {threads}, best of {args.repeats}")
    (local_job, local_engine), (ray_job, ray_engine) = best["local"], best["ray"]
    print(f"ray x1 / local: job {ray_job / local_job:.2f}x, engine {ray_engine / local_engine:.2f}x")
    print(f"answers {'identical' if same else 'DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default=str(SAMPLE))
    ap.add_argument("--model", default="default")
    ap.add_argument("--sort-window", type=int, default=500, help="Rows per window (= per Ray work unit).")
    ap.add_argument("--repeats", type=int, default=1, help="Rounds; the best of each engine is kept.")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance.")
    ap.add_argument("--object-store-mb", type=int, default=500)
    ap.add_argument("--generate", action="store_true", help="Compare generation (a tiny decoder) instead.")
    ap.add_argument("--rows", type=int, default=256, help="--generate: prompts.")
    ap.add_argument("--prompt-words", type=int, default=24, help="--generate: words per prompt.")
    ap.add_argument("--max-tokens", type=int, default=32, help="--generate: tokens per answer (EOS ignored).")
    ap.add_argument("--window-rows", type=int, default=64, help="--generate: rows per window (= per Ray unit).")
    ap.add_argument("--hidden", type=int, default=256, help="--generate: the tiny decoder's hidden size.")
    ap.add_argument("--threads", type=int, default=None, help="--generate: torch threads (default: --num-cpus).")
    args = ap.parse_args()

    import ray

    ray.init(
        num_cpus=args.num_cpus,
        object_store_memory=args.object_store_mb * 2**20,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    if args.generate:
        try:
            compare_generation(args)
        finally:
            ray.shutdown()
        return
    engines = [("local", None), ("ray", 1), ("ray", 2)]
    best: dict[str, tuple[float, float]] = {}
    outputs: dict[str, np.ndarray] = {}
    rows = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(args.repeats):
                for engine, replicas in engines:
                    name = engine if replicas is None else f"ray x{replicas}"
                    out = Path(tmp) / f"{name.replace(' ', '_')}.parquet"
                    config = job(args.input, out, args.model, args.sort_window, engine, replicas)
                    job_rps, engine_rps, rows, values = timed(config)
                    print(f"round {round_ + 1} {name:8s} job {job_rps:8.1f} rows/s  engine {engine_rps:8.1f} rows/s")
                    prev = best.get(name, (0.0, 0.0))
                    best[name] = (max(prev[0], job_rps), max(prev[1], engine_rps))
                    outputs[name] = values
    finally:
        ray.shutdown()

    local_job, local_engine = best["local"]
    print(f"\n{rows:,} rows, model {args.model}, --sort-window {args.sort_window}, best of {args.repeats}")
    print(f"{'engine':10s} {'job rows/s':>11s} {'vs local':>9s} {'engine rows/s':>14s} {'vs local':>9s}  max |diff|")
    for name, (job_rps, engine_rps) in best.items():
        diff = float(np.abs(outputs[name] - outputs["local"]).max())
        print(
            f"{name:10s} {job_rps:11.1f} {job_rps / local_job:8.2f}x {engine_rps:14.1f} "
            f"{engine_rps / local_engine:8.2f}x  {diff:.2e}"
        )
    ratio = best["ray x1"][0] / local_job
    print(f"{'PASS' if ratio >= 0.8 else 'FAIL'}: ray with 1 replica at {ratio:.2f}x the local engine (target 0.8x)")


if __name__ == "__main__":
    main()
