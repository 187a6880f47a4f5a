"""Online replay benchmark: per-request latency against the batch timeout, and saturation.

Measures the pipeline's capacity on the sample (all rows at once), then replays the same rows as
Poisson arrivals (`--rate`) at a fraction of that capacity with several batch timeouts, and once
above capacity. Prints, side by side: offered and achieved rate, batch and request latency
percentiles, and whether the report called the pipeline saturated.

    python benchmarks/speed/bench_rate.py                          # default model, 400 rows, CPU
    python benchmarks/speed/bench_rate.py --rows 200 --timeouts 50,10,2 --model path/to/checkpoint

Expected: below capacity, p99 falls as the timeout falls and achieved tracks offered; above
capacity, `saturated` is true. Exit code 1 when any of these does not hold.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq

from hpcinfer.api import run
from hpcinfer.config import InputConfig, OutputConfig, PipelineConfig, PlanConfig, RunConfig
from hpcinfer.obs.progress import Progress

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data" / "requests.parquet"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default=str(SAMPLE), help="Parquet file with id and text columns")
    p.add_argument("--rows", type=int, default=400, help="rows replayed per run")
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto")
    p.add_argument("--load", type=float, default=0.5, help="offered rate below capacity, as a share of it")
    p.add_argument("--overload", type=float, default=2.0, help="offered rate above capacity, as a multiple")
    p.add_argument("--timeouts", default="100,30,10,3", help="batch timeouts (ms) to compare, largest first")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_rate_") as tmp:
        src = Path(tmp) / "requests.parquet"
        pq.write_table(pq.read_table(args.input).slice(0, args.rows), src)
        base = RunConfig(
            input=InputConfig((str(src),)),
            model=args.model,
            plan=PlanConfig(),
            output=OutputConfig(str(Path(tmp) / "out.parquet"), overwrite=True),
            pipeline=PipelineConfig(progress="off"),
        )
        base = replace(base, device=replace(base.device, device=args.device))

        def job(rate: float | None = None, timeout_ms: float | None = None) -> dict:
            cfg = replace(
                base,
                input=replace(base.input, rate=rate, rate_seed=args.seed),
                plan=replace(base.plan, batch_timeout_ms=timeout_ms),
            )
            report = run(cfg, progress=Progress("off"))
            return {"report": report, "rate": rate, "timeout": timeout_ms}

        job(None)  # warm-up: first-call costs of the model and allocator
        capacity = job(None)["report"].rows_per_s
        print(f"capacity (all {args.rows} rows at once): {capacity:,.1f} rows/s", flush=True)

        below = capacity * args.load
        runs = [job(below, float(t)) for t in args.timeouts.split(",")]
        runs.append(job(capacity * args.overload, float(args.timeouts.split(",")[-1])))

    header = f"{'offered':>8} {'timeout':>8} {'achieved':>9} {'batch p99':>10} {'req p50':>8} {'req p90':>8}"
    print(header + f" {'req p99':>8}  saturated")
    for r in runs:
        a, b = r["report"].arrivals, r["report"].batch_latency_ms
        lat = a["latency_ms"]
        print(
            f"{a['offered_rate']:>8.1f} {r['timeout']:>6.0f}ms {a['achieved_rate']:>9.1f} {b['p99']:>8.1f}ms"
            f" {lat['p50']:>6.1f}ms {lat['p90']:>6.1f}ms {lat['p99']:>6.1f}ms  {a['saturated']}"
        )
    below_runs, over = runs[:-1], runs[-1]
    p99s = [r["report"].arrivals["latency_ms"]["p99"] for r in below_runs]
    failures = []
    if any(later > earlier for earlier, later in zip(p99s, p99s[1:], strict=False)):
        failures.append("p99 did not fall with every lower timeout")
    for r in below_runs:
        a = r["report"].arrivals
        if a["saturated"] or a["achieved_rate"] < 0.9 * a["offered_rate"]:
            failures.append(f"did not keep up at {a['offered_rate']:.1f}/s with timeout {r['timeout']:g} ms")
    if not over["report"].arrivals["saturated"]:
        failures.append("the overloaded run was not reported saturated")
    print(f"p99 request latency, timeout {args.timeouts} ms: " + " > ".join(f"{p:,.1f}" for p in p99s) + " ms")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print(
        "PASS: below capacity p99 falls with the timeout and throughput tracks the offered rate; "
        "above capacity the report says saturated"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
