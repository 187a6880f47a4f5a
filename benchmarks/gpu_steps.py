"""The GPU check's last word: steps.json (each step's status and seconds), and a failure unless every
step ran and passed. On the dry run that proves each GPU step has a CPU twin that ran.

    python benchmarks/gpu_steps.py OUT.json DRY(0|1) "NAME STATUS SECONDS"...
"""

from __future__ import annotations

import json
import sys

EXPECTED = ("environment", "checkpoint", "checks", "multi-device", "benchmark", "generation", "tensor-parallel")


def main(argv: list[str]) -> int:
    path, dry, lines = argv[0], argv[1] == "1", argv[2:]
    steps = [{"step": name, "status": status, "seconds": int(s)} for name, status, s in (x.split() for x in lines)]
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"dry_run": dry, "steps": steps}, fh, indent=1)
    passed = [s["step"] for s in steps if s["status"] == "ok"]
    missing = [name for name in EXPECTED if name not in passed]
    if missing:
        print(f"steps that did not run and pass: {', '.join(missing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
