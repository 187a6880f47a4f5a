"""Small device results read back on the host without blocking the launch that made them.

`start(values)` begins the copy (on CUDA: into pinned memory, asynchronously, with an event after
it) and returns at once; `Readback.values()` waits for that copy alone and returns the numbers.
So a host that starts step N+1 before it reads step N's tokens waits for step N only, never for
step N+1. Elsewhere the device is the host: the values are read when asked.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Readback(Protocol):
    def values(self) -> list[int]: ...


class ReadbackSource(Protocol):
    def start(self, values: torch.Tensor) -> Readback: ...


class _Ready:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def values(self) -> list[int]:
        return self.tensor.tolist()


class HostReadback:
    def start(self, values: torch.Tensor) -> Readback:
        return _Ready(values)


def readback(device: torch.device, capacity: int) -> ReadbackSource:
    """The readback for `device`; `capacity` bounds the values of one start."""
    if device.type == "cuda":
        from .cuda import CudaReadback

        return CudaReadback(device, capacity)
    return HostReadback()
