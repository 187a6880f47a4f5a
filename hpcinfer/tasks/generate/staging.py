"""A step's index arrays, sent to the device together: one host buffer (pinned on CUDA), one copy.

Every array of a step (ids, positions, KV slots, sampling rows, context lengths, block tables) is
packed back to back into the host buffer and copied with one asynchronous host-to-device copy;
what comes back are device views shaped as the arrays. A copy from pageable memory would block
the host and cost a launch per array; from pinned memory the host goes straight on.

NOTE: one buffer is enough: a step's copy is enqueued before its forward, and the host reads that
step's sampled tokens back (which waits for both) before it fills the buffer for the next step.
On the CPU nothing is copied: the views are the host buffer itself.
"""

from __future__ import annotations

import numpy as np
import torch


class StepStaging:
    def __init__(self, device: torch.device, capacity: int, copy: bool | None = None) -> None:
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy  # tests copy on the CPU too
        self.uploads = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.zeros(capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._host_np = self.host.numpy()
        self.on_device = torch.zeros(capacity, dtype=torch.int64, device=self.device) if self.copy else self.host

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Packs `arrays` (int64, any shape) back to back, copies once; device views of the same shapes."""
        total = sum(a.size for a in arrays)
        if total > self.host.numel():  # NOTE: rare (the first steps size it); grown, never shrunk
            self._allocate(max(total, 2 * self.host.numel()))
        spans, offset = [], 0
        for array in arrays:
            self._host_np[offset : offset + array.size] = array.reshape(-1)
            spans.append((offset, array.shape))
            offset += array.size
        if self.copy:
            self.on_device[:offset].copy_(self.host[:offset], non_blocking=True)
            self.uploads += 1
        return [self.on_device[start : start + int(np.prod(shape))].view(shape) for start, shape in spans]
