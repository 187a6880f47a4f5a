"""A simulated asynchronous device for tests, which also enforces CUDA's rules that can be modelled.

Each stream is a worker thread that runs launched work in order after a random delay, so copies
and "kernels" complete later than they are issued, as on a GPU. Host buffers handed out again are
scribbled over at once. A pipeline that reuses a slot or reads an output before its event has
completed therefore computes on garbage, and tests comparing results catch it.

CUDA's rules, raised as errors here, where a GPU would crash, corrupt or silently misreport:
- An event's time is readable only once it has completed (cudaEventElapsedTime: "not ready"), and
  never once the output buffer it timed was handed to another batch (the reader would be timing
  another batch's work).
- While a graph is being captured, no other thread may synchronize or query an event (global
  capture mode), and a capture that begins while another thread waits on an event is invalid.
- Work is launched only from threads that made the device current (`bind_thread`).
- A graph replays its captured work on static buffers: its output is overwritten by the next replay.
- A captured kernel keeps the cuBLAS workspace of the stream it was captured on (one per lane
  here), so graphs replayed on two compute streams must come from two lanes: one workspace used
  by two streams at once corrupts rows without an error.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator

import torch

from .base import Device, Event, Graph, Stream


class CudaRuleBroken(RuntimeError):
    """What a GPU would report (or silently suffer) at this point."""


class SimEvent(Event):
    def __init__(self, device: SimulatedDevice) -> None:
        self._device = device
        self._done = threading.Event()
        self._t = 0
        self._stale = False
        self._error: BaseException | None = None

    def fire(self) -> None:
        self._t = time.perf_counter_ns()
        self._done.set()

    def fail(self, error: BaseException) -> None:
        """Work before this event failed: waiting on it raises that error, as CUDA's sticky errors do."""
        self._error = error
        self.fire()

    def device_wait(self) -> None:
        """A stream waiting on this event: device side, not a host API call."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    def synchronize(self) -> None:
        self._device.check_host_call("an event synchronize")
        with self._device.waiting():
            self._done.wait()
        if self._error is not None:
            raise self._error

    def query(self) -> bool:
        self._device.check_host_call("an event query")
        return self._done.is_set()

    def retire(self) -> None:
        self._stale = True

    def time_ns(self) -> int:
        if self._stale:
            raise CudaRuleBroken("an event was read after its output buffer was handed to another batch")
        if not self._done.is_set():
            raise CudaRuleBroken("an event's time was read before the event completed (not ready)")
        return self._t


class SimStream(Stream):
    def __init__(self, index: int, label: str, rng: random.Random, max_delay_s: float, device: SimulatedDevice) -> None:
        self.index = index
        self.label = label
        self._rng = rng
        self._max_delay = max_delay_s
        self._device = device
        self._ops: queue.Queue[Callable[[], None] | SimEvent | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sim-{label}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (op := self._ops.get()) is not None:
            if isinstance(op, SimEvent):
                op.fire() if self._failure is None else op.fail(self._failure)
                continue
            if self._failure is not None:
                continue  # NOTE: an error is sticky, as on CUDA: later work on the stream never runs
            try:
                op()
            except BaseException as exc:  # surfaced to the host at the next launch or event wait
                self._failure = exc

    def _delayed(self, fn: Callable[[], None]) -> Callable[[], None]:
        delay = self._rng.uniform(0, self._max_delay)

        def op() -> None:
            time.sleep(delay)
            fn()

        return op

    def launch(self, fn: Callable[[], None]) -> None:
        self._device.check_bound(f"work launched on {self.label}")
        if self._failure is not None:
            raise self._failure
        self._ops.put(self._delayed(fn))

    def record(self) -> Event:
        self._device.check_bound(f"an event recorded on {self.label}")
        event = SimEvent(self._device)
        self._ops.put(event)
        return event

    def wait(self, event: Event) -> None:
        assert isinstance(event, SimEvent)
        self._ops.put(event.device_wait)

    def close(self) -> None:
        self._ops.put(None)


class SimGraph(Graph):
    """Captured work: `fn` re-run on the static inputs, its result written into the static output."""

    def __init__(
        self, fn: Callable[[], torch.Tensor], out: torch.Tensor, pool: object, workspace: int, device: SimulatedDevice
    ) -> None:
        self._fn = fn
        self.out = out
        self.pool = pool
        self.workspace = workspace  # the lane whose capture stream it was captured on
        self._device = device

    def replay(self) -> None:
        self._device.check_workspace(self.workspace)
        with torch.inference_mode():  # NOTE: the static output was made under the model's inference mode
            self.out.copy_(self._fn())


class SimulatedDevice(Device):
    kind = "simulated"
    supports_graphs = True

    def __init__(
        self,
        streams: int = 1,
        seed: int = 0,
        max_delay_s: float = 0.004,
        capture_delay_s: float = 0.002,
        *,
        seconds_per_token: float = 0.0,
        speed: float = 1.0,
    ) -> None:
        self._settings = {
            "streams": streams,
            "seed": seed,
            "max_delay_s": max_delay_s,
            "capture_delay_s": capture_delay_s,
            "seconds_per_token": seconds_per_token,
            "speed": speed,
        }
        rng = random.Random(seed)
        self.torch_device = torch.device("cpu")
        # A forward of rows x width tokens also takes rows * width * seconds_per_token / speed on its
        # stream, so devices of different speeds (multi-device dispatch tests) can be modelled.
        self.seconds_per_token = seconds_per_token
        self.speed = speed
        self.capture_delay_s = capture_delay_s  # a capture takes a while, as on a GPU
        self._lock = threading.Lock()
        self._capturing: int | None = None  # the thread capturing a graph, if any
        self._waiters: dict[int, str] = {}  # threads blocked in an event synchronize
        self._local = threading.local()
        self.bound_threads: set[str] = set()  # names of the threads that called bind_thread
        self.pools: list[object] = []
        self.captures: list[tuple[str, object]] = []  # (capturing thread, pool) per graph
        self._workspace_users: dict[int, str] = {}  # capture lane -> the stream thread that replays its graphs
        self.bind_thread()  # as torch.cuda.set_device in CudaDevice's constructor
        self.copy_stream = SimStream(0, "copy", rng, max_delay_s, self)
        self.compute_streams = [SimStream(i, f"compute{i}", rng, max_delay_s, self) for i in range(streams)]

    def bind_thread(self) -> None:
        self._local.bound = True
        with self._lock:
            self.bound_threads.add(threading.current_thread().name)

    def check_bound(self, what: str) -> None:
        if not getattr(self._local, "bound", False):
            name = threading.current_thread().name
            raise CudaRuleBroken(f"{what} from thread {name!r}, which never made this device current")

    def check_host_call(self, what: str) -> None:
        capturing = self._capturing
        if capturing is not None and capturing != threading.get_ident():
            raise CudaRuleBroken(f"{what} from another thread while a graph is being captured")

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            self._waiters[me] = threading.current_thread().name
        try:
            yield
        finally:
            with self._lock:
                self._waiters.pop(me, None)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def before_forward(self, rows: int, width: int) -> None:
        if self.seconds_per_token:  # NOTE: runs on the compute stream's thread: device time, not host time
            time.sleep(rows * width * self.seconds_per_token / self.speed)

    def on_reuse(self, host: torch.Tensor) -> None:
        # NOTE: a released buffer really is overwritten: ids become out-of-range-free garbage
        # (valid ids, wrong values) and floats become NaN, so early reuse changes results.
        if host.dtype.is_floating_point:
            host.fill_(float("nan"))
        else:
            host.fill_(7)

    def on_reuse_events(self, events: dict[str, Event]) -> None:
        for event in events.values():
            if isinstance(event, SimEvent):
                event.retire()

    def graph_pool(self) -> object:
        pool = object()
        self.pools.append(pool)
        return pool

    def check_workspace(self, workspace: int) -> None:
        """A replay on the calling stream thread through `workspace`: one stream per workspace."""
        me = threading.current_thread().name
        with self._lock:
            user = self._workspace_users.setdefault(workspace, me)
        if user != me:
            raise CudaRuleBroken(
                f"graphs replayed on {user!r} and {me!r} share the cuBLAS workspace of one capture stream"
                " (captured on the same lane): concurrent replays would corrupt each other's rows"
            )

    def capture(self, fn: Callable[[], torch.Tensor], pool: object, lane: int = 0) -> tuple[Graph, torch.Tensor]:
        me = threading.get_ident()
        with self._lock:
            if self._waiters:
                raise CudaRuleBroken(f"a graph capture began while {sorted(self._waiters.values())} waited on events")
            self._capturing = me
        try:
            time.sleep(self.capture_delay_s)
            out = fn()
        finally:
            self._capturing = None
        with self._lock:
            self.captures.append((threading.current_thread().name, pool))
        return SimGraph(fn, out, pool, lane, self), out

    def close(self) -> None:
        for stream in [self.copy_stream, *self.compute_streams]:
            stream.close()  # type: ignore[attr-defined]

    def renew(self) -> SimulatedDevice:
        self.close()
        return SimulatedDevice(**self._settings)
