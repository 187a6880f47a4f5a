"""Device time between points of a step, for engines that run on a torch device directly.

`mark()` is taken on the host between launches; `seconds(a, b)` is the device time between two
marks, valid once the work before `b` has completed (a generation step's sampling reads its tokens
back, which waits for it). On CUDA the marks are timed events, so a forward that only launches
kernels is not mistaken for a fast one and its compute for sampling; elsewhere the device is the
host and the marks are host times.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch


class StepTimer(Protocol):
    def mark(self) -> object: ...

    def seconds(self, start: object, end: object) -> float: ...


class HostStepTimer:
    """Device work runs on the calling thread: device time is host time."""

    def mark(self) -> object:
        return time.perf_counter()

    def seconds(self, start: object, end: object) -> float:
        assert isinstance(start, float) and isinstance(end, float)
        return end - start


def step_timer(device: torch.device) -> StepTimer:
    if device.type == "cuda":
        from .cuda import CudaStepTimer

        return CudaStepTimer(device)
    return HostStepTimer()
