"""Several devices: dispatch by outstanding tokens against round-robin, side by side in one run.

Runs the real pipeline on pairs of simulated asynchronous devices whose forward takes a set time
per token (the tiny random checkpoint's own compute is small beside it), over a skewed length mix
(most rows short, a few very long, in file order). For each pair (equal speeds, and 1x beside 3x)
and each dispatch rule it prints each device's share of the tokens, when each device finished,
the idle tail (how long the first device to finish waited for the last) and the wall time, then
the ratios. With `--cpu` it also runs `--devices cpu` against `--devices cpu,cpu` on this machine.

    python benchmarks/speed/bench_devices.py
    python benchmarks/speed/bench_devices.py --rows 3000 --per-token 2e-4 --cpu
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from hpcinfer.api import run  # noqa: E402
from hpcinfer.config import DeviceConfig, InputConfig, OutputConfig, PipelineConfig, PlanConfig, RunConfig  # noqa: E402
from hpcinfer.device.simulated import SimulatedDevice  # noqa: E402
from hpcinfer.obs.progress import Progress  # noqa: E402
from tests.fixtures.tiny import build_tiny_bert  # noqa: E402

WORDS = [
    *("the", "quick", "brown", "fox", "measures", "latency", "and", "throughput"),
    *("of", "batched", "inference", "on", "pinned", "memory"),
]


def skewed_rows(n: int, seed: int) -> list[dict]:
    """70% of rows of 2-8 words, 25% of 20-40, 5% of 150-200: the long ones scattered through the file."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = rng.random()
        words = rng.randint(2, 8) if kind < 0.70 else rng.randint(20, 40) if kind < 0.95 else rng.randint(150, 200)
        rows.append({"id": i, "text": " ".join(rng.choice(WORDS) for _ in range(words))})
    return rows


def one_run(src: Path, model: Path, out: Path, devices: list | None, spec: str | None, dispatch: str) -> dict:
    config = RunConfig(
        input=InputConfig((str(src),)),
        model=str(model),
        plan=PlanConfig(sort_window=1000, max_batch_tokens=1024, max_batch_size=64),
        device=DeviceConfig(devices=spec, dispatch=dispatch),
        output=OutputConfig(str(out), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
    )
    t0 = time.perf_counter()
    report = run(config, devices=devices, progress=Progress("off"))
    return {"wall_s": time.perf_counter() - t0, "rows_per_s": report.rows_per_s, "devices": report.devices}


def simulated_pair(speeds: tuple[float, float], per_token: float) -> list[SimulatedDevice]:
    return [
        SimulatedDevice(seed=k, max_delay_s=0.0005, seconds_per_token=per_token, speed=s) for k, s in enumerate(speeds)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--per-token", type=float, default=1e-4, help="simulated device seconds per token at 1x")
    p.add_argument("--cpu", action="store_true", help="also compare --devices cpu with --devices cpu,cpu")
    p.add_argument("--json", default=None, help="write all figures to this file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = build_tiny_bert(tmp_path / "tiny")
        src = tmp_path / "skewed.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in skewed_rows(args.rows, seed=7)))
        results: dict[str, dict] = {}
        warm = simulated_pair((1.0, 1.0), 0.0)  # loads and warms up the model once, untimed
        try:
            one_run(src, model, tmp_path / "warm.parquet", warm, None, "tokens")
        finally:
            for d in warm:
                d.close()
        print(f"{args.rows} rows, skewed lengths; simulated devices at {args.per_token:g} s/token (1x)")
        print(
            f"{'pair':<10} {'dispatch':<12} {'token shares':<16} {'finished s':<16} {'idle tail s':>11} {'wall s':>8}"
        )
        for speeds in ((1.0, 1.0), (1.0, 3.0)):
            for dispatch in ("round_robin", "tokens"):
                devices = simulated_pair(speeds, args.per_token)
                try:
                    r = one_run(src, model, tmp_path / "out.parquet", devices, None, dispatch)
                finally:
                    for d in devices:
                        d.close()
                finished = [d["finished_s"] for d in r["devices"]]
                r["idle_tail_s"] = max(finished) - min(finished)
                name = f"{speeds[0]:g}x+{speeds[1]:g}x"
                results[f"{name} {dispatch}"] = r
                shares = "/".join(f"{d['token_share']:.0%}" for d in r["devices"])
                ends = "/".join(f"{f:.2f}" for f in finished)
                print(
                    f"{name:<10} {dispatch:<12} {shares:<16} {ends:<16} {r['idle_tail_s']:>11.3f} {r['wall_s']:>8.2f}"
                )
        for name in ("1x+1x", "1x+3x"):
            rr, tok = results[f"{name} round_robin"], results[f"{name} tokens"]
            print(
                f"{name}: tokens/round-robin wall time {tok['wall_s'] / rr['wall_s']:.2f}x, "
                f"idle tail {tok['idle_tail_s']:.3f} s vs {rr['idle_tail_s']:.3f} s"
            )
        if args.cpu:
            for spec in ("cpu", "cpu,cpu"):
                r = one_run(src, model, tmp_path / "cpu.parquet", None, spec, "tokens")
                results[f"--devices {spec}"] = r
                print(f"--devices {spec:<8} {r['rows_per_s']:>10,.1f} rows/s  wall {r['wall_s']:.2f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
