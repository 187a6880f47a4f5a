"""Stage 4, stage: Batch -> Staged. Token ids go straight into a free staging slot, then one copy.

Only ids and lengths cross the bus; masks and positions are built on the device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from ..device import Device, StagingRing
from .types import Batch, Staged


def scatter_rows(
    dst: np.ndarray,
    flat_ids: np.ndarray,
    offsets: np.ndarray,
    rows: np.ndarray,
    lengths: np.ndarray,
    width: int,
    pad_id: int,
) -> None:
    """Writes rows of a window into dst[:n * width] as a padded [n, width] matrix, in one scatter."""
    n = len(rows)
    view = dst[: n * width]
    if n and (lengths == width).all():  # NOTE: rows of one width (an image run's pixels): a copy each, no index
        for i, start in enumerate(offsets[rows].tolist()):
            view[i * width : (i + 1) * width] = flat_ids[start : start + width]
        return
    view.fill(pad_id)
    lengths = lengths.astype(np.int64)
    row_start_packed = np.cumsum(lengths) - lengths  # where each row starts among the real tokens
    within = np.arange(int(lengths.sum())) - np.repeat(row_start_packed, lengths)
    src = np.repeat(offsets[rows], lengths) + within
    view[np.repeat(np.arange(n) * width, lengths) + within] = flat_ids[src]


class StageStep:
    """Consumes Batch, produces Staged: ids in a staging slot, H2D issued on the copy stream."""

    name = "stage"

    def __init__(self, device: Device, ring: StagingRing, pad_id: int = 0) -> None:
        self.device = device
        self.ring = ring
        self.pad_id = pad_id
        self.waited_ns = 0  # time blocked on a free slot: back-pressure, not work

    def process(self, batch: Batch) -> Iterator[Staged]:
        if batch.num_rows == 0:  # a window whose rows were all rejected: nothing to copy
            yield Staged(batch, None, None, None)
            return
        t0 = time.perf_counter_ns()
        slot = self.ring.acquire()  # waits until the slot's previous H2D copy is done
        batch.started_ns = time.perf_counter_ns()
        self.waited_ns += batch.started_ns - t0
        n, width = batch.num_rows, batch.padded_len
        w = batch.window
        scatter_rows(slot.host_ids.numpy(), w.flat_ids, w.offsets, batch.rows, batch.lengths, width, self.pad_id)
        slot.host_lengths.numpy()[:n] = batch.lengths
        copy = self.device.copy_stream
        if slot.compute_done is not None:
            copy.wait(slot.compute_done)  # the device twin is still read by the previous batch
        start = copy.record()
        m = n * width

        def h2d() -> None:
            slot.dev_ids[:m].copy_(slot.host_ids[:m], non_blocking=True)
            slot.dev_lengths[:n].copy_(slot.host_lengths[:n], non_blocking=True)

        copy.launch(h2d)
        slot.h2d_done = copy.record()
        yield Staged(batch, slot, start, slot.h2d_done)

    def finish(self) -> Iterator[Staged]:
        return iter(())
