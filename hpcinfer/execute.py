"""Stage 5, execute: Staged -> Pending. Forward on one of K compute streams, D2H into a host buffer.

Each compute stream waits on the batch's h2d_done; the staging slot goes back to the ring as soon
as the forward is issued (the next copy into it waits on compute_done on the device); the result
is guarded by d2h_done, which the writer waits on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from .device import Device, OutputPool, StagingRing
from .models.adapter import BatchModel
from .types import Pending, Staged


class Executor:
    name = "execute"

    def __init__(
        self,
        device: Device,
        model: BatchModel,
        ring: StagingRing,
        outputs: OutputPool,
        graphs: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.device = device
        self.model = model
        self.graphs = graphs  # CUDA graph replay in place of the eager forward, when enabled
        self.ring = ring
        self.outputs = outputs
        self._streams = device.compute_streams
        self.waited_ns = 0  # time blocked on a free output buffer: back-pressure, not work

    def process(self, staged: Staged) -> Iterator[Pending]:
        batch, slot = staged.batch, staged.slot
        n, width = batch.num_rows, batch.padded_len
        padded = bool(batch.lengths.min() < width)
        stream = self._streams[batch.batch_id % len(self._streams)]
        t0 = time.perf_counter_ns()
        out = self.outputs.acquire()  # blocks while the writer holds every output buffer
        self.waited_ns += time.perf_counter_ns() - t0
        result: dict[str, torch.Tensor] = {}

        def forward() -> None:
            ids = slot.dev_ids[: n * width].view(n, width)
            if self.graphs is not None:
                result["y"] = self.graphs(stream.index, ids, slot.dev_lengths[:n])
            else:
                result["y"] = self.model(ids, slot.dev_lengths[:n], padded)

        def d2h() -> None:
            out.host[:n].copy_(result.pop("y"), non_blocking=True)

        stream.wait(staged.h2d_done)
        start = stream.record()
        stream.launch(forward)
        slot.compute_done = stream.record()
        self.ring.release(slot)
        stream.launch(d2h)
        out.events = {
            "h2d_start": staged.h2d_start,
            "h2d_done": staged.h2d_done,
            "compute_start": start,
            "compute_done": slot.compute_done,
            "d2h_done": stream.record(),
        }
        yield Pending(batch, out, stream.index)

    def finish(self) -> Iterator[Pending]:
        return iter(())
