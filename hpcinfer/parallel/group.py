"""The ranks of one tensor-parallel group and the collectives the sharded decoder runs between them.

gloo on the CPU, NCCL on CUDA; every collective runs under the group's timeout, so a rank that
stops answering ends the step with an error instead of a hang. A rank that dies (its sockets
close) fails the collective at once. `Collectives` counts the calls, bytes and seconds spent in
them, for the report; on CUDA the seconds come from events on the stream that ran them.

Each group is a process group object of its own (its own TCP store and port), not torch's
default group: one process holds rank 0 of several groups when `--devices` lists several groups'
devices (one engine thread per group), and a process has only one default group.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend  # a group's gloo or NCCL backend, usable without the default group

from ..device.cuda import new_event
from ..errors import HpcinferError

FOLD_EVENTS = 512  # CUDA event pairs kept before their times are read (one sync of the last)


class RankFailed(HpcinferError):
    """A tensor-parallel rank died or stopped answering: the run ends, its committed windows kept."""

    exit_code = 1


def free_port() -> int:
    """A TCP port free on this host now, for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Collectives:
    """One rank's view of its group: all-reduce, all-gather, gather to rank 0, a minimum, a broadcast; timed.

    `on_error(exc)` turns a failed collective into the error the run reports (the rank that died,
    when it can be told); by default the error itself.
    """

    def __init__(
        self,
        group: Backend,
        device: torch.device,
        on_error: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        self.group, self.device = group, device
        self.rank, self.world = group.rank(), group.size()
        self.on_error = on_error or (lambda exc: exc)
        self.calls = 0
        self.bytes = 0
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []  # (start, end) CUDA events of collectives not yet summed

    @property
    def seconds(self) -> float:
        self._fold()
        return self._seconds

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        self._run(lambda: self.group.allreduce([x]), x.nbytes)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x of every rank -> [world, *x.shape] on every rank (rank r's at r)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._run(lambda: self.group.allgather([parts], [x]), x.nbytes)
        return torch.stack(parts)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [S, n] of every rank -> [S, world * n] on rank 0 (rank r's columns at r * n), None elsewhere."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._run(lambda: self.group.gather([parts] if parts else [], [x], opts), x.nbytes)
        return torch.cat(parts, dim=-1) if parts else None

    def all_min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (the KV pool's blocks: every rank must hold as many)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._run(lambda: self.group.allreduce([t], opts), t.nbytes)
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._run(lambda: self.group.broadcast([x], opts), x.nbytes)
        return x

    def _run(self, op: Callable[[], dist.Work], nbytes: int) -> None:
        self.calls += 1
        self.bytes += nbytes
        cuda = self.device.type == "cuda"
        start = new_event() if cuda else None
        if start is not None:
            start.record()
        t0 = time.perf_counter()
        try:
            op().wait()
        except Exception as exc:
            raise self.on_error(exc) from None
        if start is None:
            self._seconds += time.perf_counter() - t0
            return
        end = new_event()
        end.record()
        self._events.append((start, end))
        if len(self._events) >= FOLD_EVENTS:
            self._fold()

    def _fold(self) -> None:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()


class Rendezvous:
    """The group's TCP store: ranks say where they are (`mark`) and rank 0 waits for them while it
    watches its rank processes (`wait`), so a rank that fails to start ends the wait at once."""

    def __init__(self, rank: int, world: int, port: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout, wait_for_workers=False)

    def mark(self, stage: str) -> None:
        self.store.set(f"{stage}/{self.rank}", "1")

    def wait(self, stage: str, check: Callable[[], None]) -> None:
        """Until every other rank has marked `stage`; `check()` raises when one of them has died."""
        keys = [f"{stage}/{r}" for r in range(1, self.world)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            check()
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel ranks did not reach {stage!r} within {self.timeout_s:g} s")
            time.sleep(0.02)

    def join(self, device: torch.device) -> Backend:
        """The group's process group on this rank; `timeout_s` bounds every collective in it."""
        timeout = timedelta(seconds=self.timeout_s)
        if device.type != "cuda":
            return dist.ProcessGroupGloo(self.store, self.rank, self.world, timeout)
        nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]  # absent from CPU builds of torch
        options = nccl.Options()
        options._timeout = timeout
        group = nccl(self.store, self.rank, self.world, options)
        group.eager_connect_single_device(device)  # NOTE: its communicator on this rank's device, not cuda:0
        return group


def end_group(group: Backend | None) -> None:
    """Leaves the group (its sockets or NCCL communicator freed now, not at exit)."""
    if group is not None:
        with contextlib.suppress(Exception):
            group.shutdown()
