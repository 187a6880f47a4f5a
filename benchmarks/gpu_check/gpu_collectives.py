"""The tensor-parallel group's collectives on this machine, world size 1: NCCL on CUDA, gloo on the CPU.

One GPU cannot run tensor parallelism, but the group it would run through can be checked: a
rendezvous, NCCL's communicator on the device (hpcinfer/parallel/group.py, as a rank of `--tp`
joins it), then all-reduce, all-gather, gather, minimum and broadcast, each checked against what
one rank must get back (its own data) and timed (median of `--repeats`, CUDA events on the GPU).

    python benchmarks/gpu_check/gpu_collectives.py [--device cuda|cpu] [--mib 64] [--json out.json] [--deadline S]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # NOTE: runs from a checkout, installed or not

from benchmarks.gpu_check.gpu_results import Deadline, add_deadline, attempt, write_json  # noqa: E402
from hpcinfer.parallel.group import Collectives, Rendezvous, end_group, free_port  # noqa: E402


def checks(comm: Collectives, x: torch.Tensor) -> dict[str, Callable[[], bool]]:
    """Each collective, and whether a group of one gave back what it must."""
    return {
        "all_reduce": lambda: torch.equal(comm.all_reduce(x.clone()), x),
        "all_gather": lambda: torch.equal(comm.all_gather(x), x[None]),
        "gather": lambda: torch.equal(comm.gather_columns(x.view(-1, 1)), x.view(-1, 1)),  # type: ignore[arg-type]
        "broadcast": lambda: torch.equal(comm.broadcast(x.clone()), x),
        "all_min": lambda: comm.all_min(7) == 7,
    }


def run(device: torch.device, elements: int, repeats: int, deadline: Deadline) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NOTE: NCCL's communicator and every stream on this rank's device
    t0 = time.perf_counter()
    group = Rendezvous(0, 1, free_port(), 60.0).join(device)
    figures: dict[str, Any] = {"backend": group.name(), "world": group.size(), "join_s": time.perf_counter() - t0}
    if device.type == "cuda":
        figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    comm = Collectives(group, device)
    x = torch.arange(elements, dtype=torch.float32, device=device)
    ops: dict[str, Any] = {}
    try:
        for name, op in checks(comm, x).items():
            result, failed = attempt(name, lambda op=op: timed(op, comm, repeats), deadline)
            ops[name] = failed or result
    finally:
        end_group(group)
    figures["ops"] = ops
    figures["bytes"] = x.nbytes
    return figures


def timed(op: Callable[[], bool], comm: Collectives, repeats: int) -> dict[str, Any]:
    ok, laps = True, []
    for _ in range(repeats):
        before = comm.seconds
        ok = op() and ok
        laps.append(comm.seconds - before)
    if not ok:
        raise AssertionError("a group of one did not get its own data back")
    return {"status": "ok", "us": statistics.median(laps) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--mib", type=float, default=None, help="tensor size (default: 64 on CUDA, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    add_deadline(p)
    args = p.parse_args(argv)
    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda:0" if kind == "cuda" else "cpu")
    elements = int((args.mib or (64 if kind == "cuda" else 1)) * 2**20 // 4)
    figures, failed = attempt(
        "collectives", lambda: run(device, elements, args.repeats, Deadline(args.deadline)), Deadline(None)
    )
    result = failed or figures or {}
    ok = failed is None and all(op.get("status") == "ok" for op in result.get("ops", {}).values())
    result = {"status": "ok" if ok else "error", **result}
    if args.json is not None:
        write_json(args.json, result)
    for name, op in result.get("ops", {}).items():
        print(f"  {name:<10} {op.get('status')}  {op.get('us', float('nan')):10.1f} us")
    print(f"collectives ({result.get('backend', '?')}, world {result.get('world', '?')}): {result['status']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
