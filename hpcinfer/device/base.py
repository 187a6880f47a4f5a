"""The device layer's interface: streams, events, host/device buffers and the staging ring.

Stage code talks only to these types; CUDA, CPU and the simulated asynchronous device implement
them. Events carry completion time on a common `perf_counter_ns` timeline so device work can be
reported and traced next to host stages.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


class Cancelled(Exception):
    """Raised in a stage blocked on a resource when the run is stopping."""


def get_unless_stopped(q: queue.Queue, stop: threading.Event | None):  # noqa: ANN201
    """queue.get that gives up (raising Cancelled) once `stop` is set."""
    while True:
        try:
            return q.get(timeout=0.05)
        except queue.Empty:
            if stop is not None and stop.is_set():
                raise Cancelled from None


class DeviceOutOfMemory(MemoryError):
    """An allocator failure on the device (tests inject it through Device.before_forward)."""


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    # NOTE: the CPU allocator reports failure as a plain RuntimeError.
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


class Event(ABC):
    @abstractmethod
    def synchronize(self) -> None:
        """Blocks the calling host thread until the work recorded before this event is done."""

    @abstractmethod
    def query(self) -> bool:
        """Whether the work recorded before this event is done, without waiting."""

    @abstractmethod
    def time_ns(self) -> int:
        """Completion time on the perf_counter_ns timeline; only valid after synchronize()."""


class Graph(ABC):
    """Device work captured once and replayed; it reads and writes the same static buffers every time."""

    @abstractmethod
    def replay(self) -> None:
        """Re-issues the captured work on the current stream (call it inside Stream.launch)."""


class Stream(ABC):
    index: int
    label: str

    @abstractmethod
    def launch(self, fn: Callable[[], None]) -> None:
        """Issues `fn` (which enqueues copies/kernels) in this stream's order."""

    @abstractmethod
    def record(self) -> Event:
        """An event that completes when all work launched so far on this stream is done."""

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Makes later work on this stream wait for `event`, without blocking the host."""


class Device(ABC):
    kind: str
    torch_device: torch.device
    copy_stream: Stream
    compute_streams: list[Stream]
    supports_graphs = False

    def bind_thread(self) -> None:
        """Makes this device current in the calling thread; every thread that launches work calls it first.

        NOTE: the current device is per thread (torch.cuda.set_device in one thread leaves the others
        on GPU 0), so the pipeline calls this at the start of every stage thread.
        """
        return None

    @abstractmethod
    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for transfers (page-locked on CUDA), allocated once and recycled."""

    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def on_reuse(self, host: torch.Tensor) -> None:
        """Called when a host buffer is handed out again; the simulated device scribbles on it."""
        return None

    def before_forward(self, rows: int, width: int) -> None:
        """Called before each forward of [rows, width]; a fault-injecting device raises here."""
        return None

    def on_reuse_events(self, events: dict[str, Event]) -> None:
        """Called when an output buffer is handed out again: its previous batch's events are stale now."""
        return None

    def peak_memory_bytes(self) -> int | None:
        return None

    def synchronize(self) -> None:
        """Blocks until all work issued so far on every stream is done."""
        for stream in [self.copy_stream, *self.compute_streams]:
            stream.record().synchronize()

    def graph_pool(self) -> object:
        """A memory pool graphs can be captured into and share (see graphs.py)."""
        raise ConfigError(f"--cuda-graphs needs a CUDA device (the {self.kind} device captures no graphs)")

    def warm_up(self, fn: Callable[[], object], lane: int = 0) -> None:
        """Runs `fn` eagerly, outside any capture, so one-off lazy setup does not land in a graph.

        `lane` is the compute stream the work will replay on: see `capture`.
        """
        fn()

    def capture(self, fn: Callable[[], torch.Tensor], pool: object, lane: int = 0) -> tuple[Graph, torch.Tensor]:
        """Captures the device work `fn` issues into a graph; returns it and fn's (static) output.

        `lane` is the compute stream whose work this graph replays. NOTE: graphs of different lanes
        must be captured on different streams: a captured kernel keeps the cuBLAS workspace of the
        stream it was captured on (cached per handle and stream), and two lanes replaying at once
        through one workspace would corrupt each other's rows silently.
        """
        raise ConfigError(f"--cuda-graphs needs a CUDA device (the {self.kind} device captures no graphs)")

    def release_cached_memory(self) -> None:
        """Returns cached device memory (freed graphs, for one) to the driver."""
        return None

    def close(self) -> None:
        """Stops background workers, if any."""
        return None

    def renew(self) -> Device:
        """The same device with fresh streams, for a trial after a fault (an error on a stream is
        sticky); this one is closed. A device without streams of its own is itself."""
        return self


@dataclass(slots=True)
class StagingSlot:
    """One pinned staging buffer and its device twin, sized for the token budget."""

    index: int
    host_ids: torch.Tensor  # int32 [max_batch_tokens]
    host_lengths: torch.Tensor  # int32 [max_batch_size]
    dev_ids: torch.Tensor
    dev_lengths: torch.Tensor
    h2d_done: Event | None = None  # NOTE: the host buffer may be rewritten only after this
    compute_done: Event | None = None  # NOTE: the device buffer may be rewritten only after this


class StagingRing:
    """N slots; N=2 is double buffering.

    A slot comes back (release) once the executor has issued the forward that reads it, with
    compute_done set; acquire then also waits, on the host, for the slot's h2d_done.
    """

    def __init__(
        self,
        device: Device,
        slots: int,
        max_tokens: int,
        max_rows: int,
        stop: threading.Event | None = None,
        dtype: torch.dtype = torch.int32,
    ) -> None:
        """`dtype`: of the ids (token ids; uint8 for an image run's pixels)."""
        self.device = device
        self.stop = stop
        self.slots = [
            StagingSlot(
                i,
                device.host_buffer((max_tokens,), dtype),
                device.host_buffer((max_rows,), torch.int32),
                device.device_buffer((max_tokens,), dtype),
                device.device_buffer((max_rows,), torch.int32),
            )
            for i in range(slots)
        ]
        self._free: queue.Queue[StagingSlot] = queue.Queue()
        for slot in self.slots:
            self._free.put(slot)

    def acquire(self) -> StagingSlot:
        slot = get_unless_stopped(self._free, self.stop)
        self.wait_reusable(slot)
        self.device.on_reuse(slot.host_ids)
        self.device.on_reuse(slot.host_lengths)
        return slot

    def release(self, slot: StagingSlot) -> None:
        self._free.put(slot)

    @staticmethod
    def wait_reusable(slot: StagingSlot) -> None:
        if slot.h2d_done is not None:
            slot.h2d_done.synchronize()


@dataclass(slots=True)
class OutputBuffer:
    """Where one batch's results land on the host: dense rows in `host`, or a head's ragged items
    in `arenas` (one growable host buffer per field, `items` of them used by this batch)."""

    index: int
    host: torch.Tensor  # float32 [max_batch_size, dim]
    device: Device
    events: dict[str, Event] = field(default_factory=dict)
    arenas: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # this batch's part of each arena
    items: int | None = None  # ragged results: items in the arenas; None for dense rows

    def arena(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of `shape` for field `name` (page-locked on CUDA), grown (doubled) only when
        a batch needs more than it ever did: after the first batches, none is allocated."""
        need = 1
        for size in shape:
            need *= size
        buf = self.arenas.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < need:
            grown = max(need, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0, 1)
            buf = self.arenas[name] = self.device.host_buffer((grown,), dtype)
        view = self.views[name] = buf[:need].view(shape)
        return view


class OutputPool:
    """Host buffers results are copied into; the writer returns each after d2h_done."""

    def __init__(
        self, device: Device, count: int, max_rows: int, dim: int, stop: threading.Event | None = None
    ) -> None:
        self.device = device
        self.stop = stop
        self._free: queue.Queue[OutputBuffer] = queue.Queue()
        for i in range(count):
            self._free.put(OutputBuffer(i, device.host_buffer((max_rows, dim), torch.float32), device))

    def acquire(self) -> OutputBuffer:
        buf = get_unless_stopped(self._free, self.stop)
        self.device.on_reuse(buf.host)
        for arena in buf.arenas.values():
            self.device.on_reuse(arena)
        self.device.on_reuse_events(buf.events)
        buf.items = None
        buf.views.clear()
        return buf

    def release(self, buf: OutputBuffer) -> None:
        self._free.put(buf)
