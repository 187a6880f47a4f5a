"""The CUDA device: pinned host buffers, one copy stream, K compute streams, timed events.

This module (with `graphs.py`) is the only place that touches `torch.cuda`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .base import Device, Event, Stream


class CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event, clock: CudaClock) -> None:
        self._event = event
        self._clock = clock

    def synchronize(self) -> None:
        self._event.synchronize()

    def time_ns(self) -> int:
        return self._clock.to_host_ns(self._event)


class CudaClock:
    """Maps CUDA event times onto perf_counter_ns through one reference event."""

    def __init__(self, device: torch.device) -> None:
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(torch.cuda.current_stream(device))
        self._ref.synchronize()
        self._ref_ns = time.perf_counter_ns()

    def to_host_ns(self, event: torch.cuda.Event) -> int:
        return self._ref_ns + int(self._ref.elapsed_time(event) * 1e6)


class CudaStream(Stream):
    def __init__(self, index: int, label: str, device: torch.device, clock: CudaClock) -> None:
        self.index = index
        self.label = label
        self._stream = torch.cuda.Stream(device=device)
        self._clock = clock

    def launch(self, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(self._stream):
            fn()

    def record(self) -> Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return CudaEvent(event, self._clock)

    def wait(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        self._stream.wait_event(event._event)


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self, device: torch.device, streams: int = 1) -> None:
        torch.cuda.set_device(device)
        self.torch_device = device
        self._clock = CudaClock(device)
        self.copy_stream = CudaStream(0, "copy", device, self._clock)
        self.compute_streams = [CudaStream(i, f"compute{i}", device, self._clock) for i in range(streams)]
        torch.cuda.reset_peak_memory_stats(device)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).pin_memory()

    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def close(self) -> None:
        torch.cuda.synchronize(self.torch_device)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def best_half_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
