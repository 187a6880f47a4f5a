"""The GPU check's last word: a failure unless every step ran and passed (steps.json, written by
gpu_check.sh after every step and by its exit trap). On the dry run that proves each GPU step has
a CPU twin that ran.

    python benchmarks/gpu_check/gpu_steps.py STEPS.json
"""

from __future__ import annotations

import json
import sys

EXPECTED = (
    "environment",
    "checkpoint",
    "checks",
    "collectives",
    "multi-device",
    "tensor-parallel",
    "paged-attention",
    "generation",
    "benchmark",
    "benchmark-decoder",
)


def verdict(steps: list[dict]) -> list[str]:
    """The expected steps that did not run and pass, each with what happened to it."""
    status = {s["step"]: s["status"] for s in steps}
    return [f"{name} ({status.get(name, 'not run')})" for name in EXPECTED if status.get(name) != "ok"]


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as fh:
        steps = json.load(fh)["steps"]
    missing = verdict(steps)
    if missing:
        print(f"steps that did not run and pass: {', '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
