"""The synchronous CPU device: same interface, work runs at launch, events are already done."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .base import Device, Event, Stream
from .threads import set_torch_threads


class DoneEvent(Event):
    def __init__(self) -> None:
        self._t = time.perf_counter_ns()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def time_ns(self) -> int:
        return self._t


class InlineStream(Stream):
    def __init__(self, index: int, label: str) -> None:
        self.index = index
        self.label = label

    def launch(self, fn: Callable[[], None]) -> None:
        fn()

    def record(self) -> Event:
        return DoneEvent()

    def wait(self, event: Event) -> None:
        return None


class CpuDevice(Device):
    kind = "cpu"

    def __init__(self, streams: int = 1, threads: int | None = None) -> None:
        self.threads = threads  # intra-op threads of the threads that compute here (several CPU replicas split them)
        self.torch_device = torch.device("cpu")
        self.copy_stream = InlineStream(0, "copy")
        self.compute_streams = [InlineStream(i, f"compute{i}") for i in range(streams)]

    def bind_thread(self) -> None:
        if self.threads:  # NOTE: OpenMP's thread count is per calling thread, so each replica keeps its share
            set_torch_threads(self.threads)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)
