"""A mixture-of-experts layer over one decode step: its experts one by one, all in one batched
matmul where the CPU's bfloat16 takes it ("default"), and one by one on column-major weights (what
the loader gives float32 experts on the CPU: `MoE.column_major`), side by side in one run, per
dtype, with a dense MLP of the same active parameters beside them (models/moe.py).

The layer has bench_decoders.py's Qwen3-MoE shape (640 hidden, 32 experts of 512, 4 a token: the
active parameters of a 2,048-wide dense MLP), random weights; `--rows` rows (a decode step of that
many sequences), routed by a random router, so the busiest expert gets more than its mean. Each
form runs `--repeats` rounds, interleaved, and the best round counts.

    python benchmarks/speed/bench_moe.py [--rows 128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line  # noqa: E402

HIDDEN, EXPERTS, TOP_K, EXPERT_WIDTH, DENSE_WIDTH = 640, 32, 4, 512, 2048


def best_ms(forms: dict[str, Callable[[], object]], repeats: int, calls: int = 10) -> dict[str, float]:
    """Each form's best round of `calls` calls, in ms a call; the forms' rounds interleaved."""
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(repeats):
        for name, form in forms.items():
            start = time.perf_counter()
            for _ in range(calls):
                form()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e3)
    return best


def measure(dtype: object, rows: int, repeats: int) -> str:
    """The line of one dtype: the layer one by one, by default and a dense MLP, in ms a call."""
    import torch
    import torch.nn.functional as F

    from hpcinfer.models import moe
    from hpcinfer.models.moe import MoE

    layer = MoE(HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K, True, F.silu)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer = layer.to(dtype)
    gate_up = torch.randn(2 * DENSE_WIDTH, HIDDEN, dtype=dtype) * 0.02
    down = torch.randn(HIDDEN, DENSE_WIDTH, dtype=dtype) * 0.02
    h = torch.randn(rows, HIDDEN, dtype=dtype)
    experts, _ = layer.route(h)
    counts = torch.bincount(experts.flatten(), minlength=EXPERTS)
    width = MoE._batch_width(h, counts)

    def one_by_one() -> object:
        most = moe.MOST_SLOTS
        moe.MOST_SLOTS = 0  # no step batches: every expert on its own
        try:
            return layer(h)
        finally:
            moe.MOST_SLOTS = most

    laid = copy.deepcopy(layer)
    laid.column_major()  # what the loader does where the experts run one by one (models/moe.py)

    def column_major() -> object:
        most = moe.MOST_SLOTS
        moe.MOST_SLOTS = 0
        try:
            return laid(h)
        finally:
            moe.MOST_SLOTS = most

    def dense() -> object:
        gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)

    with torch.inference_mode():
        forms = {"one by one": one_by_one, "default": lambda: layer(h), "column-major": column_major, "dense": dense}
        ms = best_ms(forms, repeats)
        apart = float((one_by_one() - column_major()).abs().max())
    chosen = f"batched, {width} slots an expert" if width else "one by one"
    return (
        f"{str(dtype).removeprefix('torch.')}, {rows} rows (busiest expert {int(counts.max())}, mean "
        f"{rows * TOP_K / EXPERTS:.0f}): one by one {ms['one by one']:.2f} ms, default ({chosen}) "
        f"{ms['default']:.2f} ms: {ms['one by one'] / ms['default']:.2f}x; a dense MLP of the same active "
        f"parameters {ms['dense']:.2f} ms (the MoE layer {ms['default'] / ms['dense']:.2f}x its time); "
        f"one by one on column-major weights {ms['column-major']:.2f} ms ({ms['one by one'] / ms['column-major']:.2f}x "
        f"one by one, {ms['column-major'] / ms['dense']:.2f}x the dense MLP; largest difference {apart:.1e})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128, help="rows in the step (one per decoding sequence)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch

    print(cpu_line(torch.get_num_threads() or os.cpu_count() or 1))
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        print(measure(dtype, args.rows, args.repeats), flush=True)


if __name__ == "__main__":
    main()
