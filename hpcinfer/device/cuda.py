"""The CUDA device: pinned host buffers, one copy stream, K compute streams, timed events, graphs.

This module is the only place that touches `torch.cuda`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import Device, Event, Graph, Stream
from .clock import EventClock


def new_event() -> torch.cuda.Event:
    """A timed event whose synchronize() sleeps the waiting thread instead of spinning a core.

    NOTE: the writer and the stage step wait on events all run long; a spinning wait (the default)
    would keep a CPU core busy that the tokenizer needs.
    """
    return torch.cuda.Event(enable_timing=True, blocking=True)


class CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event, clock: EventClock[torch.cuda.Event]) -> None:
        self._event = event
        self._clock = clock

    def synchronize(self) -> None:
        self._event.synchronize()

    def query(self) -> bool:
        return bool(self._event.query())

    def time_ns(self) -> int:
        return self._clock.to_host_ns(self._event)


def cuda_clock(device: torch.device) -> EventClock[torch.cuda.Event]:
    """An EventClock whose references are recorded on a stream of their own, idle, so they complete at once."""
    stream = torch.cuda.Stream(device=device)

    def reference() -> torch.cuda.Event:
        # NOTE: a spinning (non-blocking) event here: it completes within microseconds, and waking a
        # sleeping thread would add its latency to every host time that follows.
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        event.synchronize()
        return event

    return EventClock(reference, lambda a, b: a.elapsed_time(b))


class CudaStream(Stream):
    def __init__(self, index: int, label: str, device: torch.device, clock: EventClock[torch.cuda.Event]) -> None:
        self.index = index
        self.label = label
        self._stream = torch.cuda.Stream(device=device)
        self._clock = clock

    def launch(self, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(self._stream):
            fn()

    def record(self) -> Event:
        event = new_event()
        event.record(self._stream)
        return CudaEvent(event, self._clock)

    def wait(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        self._stream.wait_event(event._event)


class CudaGraph(Graph):
    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self._graph = graph

    def replay(self) -> None:
        self._graph.replay()


class CaptureStream:
    """One stream of one device on which graphs are warmed up and then captured (the decode graphs).

    NOTE: warm-up and capture on the same stream, made on the graphs' own device:
    - the first calls on a stream allocate its cuBLAS workspace; in the warm-up that happens
      outside the graphs' memory pool, whereas a capture on another stream (torch's process-wide
      capture stream, when none is given) would allocate a second workspace inside the pool;
    - torch's capture stream, and a stream made without a device, belong to the current device:
      an engine on cuda:1 would capture its graphs on a stream of cuda:0.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device=device)

    def warm_up(self, fn: Callable[[], object], times: int = 2) -> None:
        """Runs `fn` `times` times on the stream, ordered after the work already issued."""
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(times):
                    fn()
            current.wait_stream(self.stream)

    def capture(self, fn: Callable[[], object], pool: object) -> torch.cuda.CUDAGraph:
        """`fn` captured on the stream into a graph that allocates from `pool`."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=pool, stream=self.stream):
            fn()
        return graph

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class CudaDevice(Device):
    kind = "cuda"
    supports_graphs = True

    def __init__(self, device: torch.device, streams: int = 1) -> None:
        self.torch_device = device
        self.bind_thread()
        self._clock = cuda_clock(device)
        self.copy_stream = CudaStream(0, "copy", device, self._clock)
        self.compute_streams = [CudaStream(i, f"compute{i}", device, self._clock) for i in range(streams)]
        # One capture stream per compute stream (warm-ups and captures, never the hot path): each
        # lane's graphs get a cuBLAS workspace of their own (see Device.capture).
        self._capture_streams = [torch.cuda.Stream(device=device) for _ in range(streams)]
        torch.cuda.reset_peak_memory_stats(device)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.torch_device)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).pin_memory()

    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def graph_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], object], lane: int = 0) -> None:
        # NOTE: on the lane's capture stream, as torch.cuda.graph requires: the first calls allocate
        # that stream's cuBLAS workspace and pick kernels, none of which may happen inside a capture.
        side, current = self._capture_streams[lane], torch.cuda.current_stream(self.torch_device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        current.wait_stream(side)
        side.synchronize()

    def capture(self, fn: Callable[[], torch.Tensor], pool: object, lane: int = 0) -> tuple[Graph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # NOTE: "global" capture mode: any other thread's unsafe call (an event synchronize or query)
        # during the capture is an error. Graphs are captured before the stage threads start, so
        # none can happen; should that ever change, this fails loudly instead of corrupting a graph.
        with torch.cuda.graph(graph, pool=pool, stream=self._capture_streams[lane], capture_error_mode="global"):
            out = fn()
        return CudaGraph(graph), out

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    def close(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def renew(self) -> CudaDevice:
        # NOTE: fresh streams and events; an error that poisoned the CUDA context fails the trial again
        return CudaDevice(self.torch_device, len(self.compute_streams))


def capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `tensor`'s device (False off
    CUDA): a forward may not read a value back from the device then."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def cuda_available() -> bool:
    return torch.cuda.is_available()


def best_half_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class CudaStepTimer:
    """Timed events on the device's current stream (device/step_timer.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> object:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: object, end: object) -> float:
        assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class _CudaPending:
    def __init__(self, host: torch.Tensor, event: torch.cuda.Event) -> None:
        self.host, self.event = host, event

    def values(self) -> list[int]:
        self.event.synchronize()
        return self.host.tolist()


class CudaReadback:
    """Device values copied into pinned host buffers, two in turn (device/readback.py).

    NOTE: two, because a step's values are read after the next step's copy has begun: a buffer
    is written again only once its values were read.
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self._buffers = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._turn = 0

    def start(self, values: torch.Tensor) -> _CudaPending:
        host = self._buffers[self._turn][: values.numel()]
        self._turn ^= 1
        host.copy_(values, non_blocking=True)
        event = new_event()
        event.record(torch.cuda.current_stream(self.device))
        return _CudaPending(host, event)
