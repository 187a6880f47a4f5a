"""A simulated asynchronous device for tests.

Each stream is a worker thread that runs launched work in order after a random delay, so copies
and "kernels" complete later than they are issued, as on a GPU. Host buffers handed out again are
scribbled over at once. A pipeline that reuses a slot or reads an output before its event has
completed therefore computes on garbage, and tests comparing results catch it.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable

import torch

from .base import Device, Event, Stream


class SimEvent(Event):
    def __init__(self) -> None:
        self._done = threading.Event()
        self._t = 0

    def fire(self) -> None:
        self._t = time.perf_counter_ns()
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()

    def time_ns(self) -> int:
        return self._t


class SimStream(Stream):
    def __init__(self, index: int, label: str, rng: random.Random, max_delay_s: float) -> None:
        self.index = index
        self.label = label
        self._rng = rng
        self._max_delay = max_delay_s
        self._ops: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sim-{label}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (op := self._ops.get()) is not None:
            try:
                op()
            except BaseException as exc:  # surfaced to the host at the next launch
                self._failure = exc

    def _delayed(self, fn: Callable[[], None]) -> Callable[[], None]:
        delay = self._rng.uniform(0, self._max_delay)

        def op() -> None:
            time.sleep(delay)
            fn()

        return op

    def launch(self, fn: Callable[[], None]) -> None:
        if self._failure is not None:
            raise self._failure
        self._ops.put(self._delayed(fn))

    def record(self) -> Event:
        event = SimEvent()
        self._ops.put(event.fire)
        return event

    def wait(self, event: Event) -> None:
        self._ops.put(event.synchronize)

    def close(self) -> None:
        self._ops.put(None)


class SimulatedDevice(Device):
    kind = "simulated"

    def __init__(self, streams: int = 1, seed: int = 0, max_delay_s: float = 0.004) -> None:
        rng = random.Random(seed)
        self.torch_device = torch.device("cpu")
        self.copy_stream = SimStream(0, "copy", rng, max_delay_s)
        self.compute_streams = [SimStream(i, f"compute{i}", rng, max_delay_s) for i in range(streams)]

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def on_reuse(self, host: torch.Tensor) -> None:
        # NOTE: a released buffer really is overwritten: ids become out-of-range-free garbage
        # (valid ids, wrong values) and floats become NaN, so early reuse changes results.
        if host.dtype.is_floating_point:
            host.fill_(float("nan"))
        else:
            host.fill_(7)

    def close(self) -> None:
        for stream in [self.copy_stream, *self.compute_streams]:
            stream.close()  # type: ignore[attr-defined]
