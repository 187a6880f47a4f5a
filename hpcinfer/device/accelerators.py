"""What the machine's CUDA devices are and hold, for the code that places work on them: how many,
their properties, free and peak memory, the current one. The one place outside the device
classes (cuda.py) that asks torch.cuda; on a machine without CUDA every answer is "none".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_kind() -> str:
    """What `--device auto` means here: cuda where there is one, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_properties(index: int) -> Any:
    return torch.cuda.get_device_properties(index)


def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def free_bytes(device: torch.device) -> int:
    """Memory free on a CUDA device now."""
    free, _total = torch.cuda.mem_get_info(device)
    return free


def make_current(device: torch.device) -> None:
    """The calling thread's current CUDA device (a no-op for any other kind)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


@contextlib.contextmanager
def current(device: torch.device) -> Iterator[None]:
    """Within: `device` is current, so what is made lands there (a no-op for any other kind)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        yield


def release_cached(device: torch.device) -> None:
    """The caching allocator's free blocks back to the device (after a failure, between trials)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def start_peak(device: torch.device) -> None:
    """Peak memory counted from now (see `peak_bytes`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    """The most memory allocated on a CUDA device since `start_peak`, once its work is done."""
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
