"""A step's index arrays, sent to the device together: one host buffer (pinned on CUDA), one copy.

Every array of a step (ids, positions, KV slots, sampling rows, context lengths, block tables) is
packed into the host buffer, each from a 16-byte boundary, and copied with one asynchronous
host-to-device copy; what comes back are device views shaped as the arrays. A copy from pageable memory would block
the host and cost a launch per array; from pinned memory the host goes straight on.

NOTE: two host buffers, in turn: with the engine a step ahead, the host fills step N+1's inputs
while step N's copy may still wait behind step N-1 on the device; by the time it fills step N+2's
(the same buffer as step N's) it has read step N's tokens back, which came after that copy. On
the CPU nothing is copied: the views are the host buffer itself.
"""

from __future__ import annotations

import numpy as np
import torch

from .sequence import Sequence

ALIGN = 2  # int64 elements: 16 bytes


class StepStaging:
    def __init__(self, device: torch.device, capacity: int, copy: bool | None = None) -> None:
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy  # tests copy on the CPU too
        self.uploads = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        pin = self.device.type == "cuda"
        self._hosts = [torch.zeros(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(2 if self.copy else 1)]
        self._turn = 0
        self.host = self._hosts[0]
        self.on_device = torch.zeros(capacity, dtype=torch.int64, device=self.device) if self.copy else self.host

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Packs `arrays` (int64, any shape) back to back, copies once; device views of the same shapes.

        NOTE: each array starts on a 16-byte boundary (an even int64 offset): Triton specialises a
        pointer argument on 16-byte alignment, and a table or context view whose alignment flipped
        with the sizes of the arrays before it would compile the paged kernel again mid-run.
        """
        offsets, offset = [], 0
        for array in arrays:
            offsets.append(offset)
            offset += array.size + -array.size % ALIGN
        if offset > self.host.numel():  # NOTE: rare (the first steps size it); grown, never shrunk
            self._allocate(max(offset, 2 * self.host.numel()))
        self.host = self._hosts[self._turn]
        self._turn = (self._turn + 1) % len(self._hosts)
        host_np = self.host.numpy()
        for array, start in zip(arrays, offsets, strict=True):
            host_np[start : start + array.size] = array.reshape(-1)
        if self.copy:
            self.on_device[:offset].copy_(self.host[:offset], non_blocking=True)
            self.uploads += 1
        return [self.on_device[start : start + a.size].view(a.shape) for a, start in zip(arrays, offsets, strict=True)]


class InFlightTokens:
    """The sampled tokens of the step in flight, on the device, as inputs for the step after it.

    A decode whose input token is still PENDING takes it from here by its row (`index_of`);
    `fill` puts those tokens into the step's ids on the device, so the host never waits for them.
    """

    def __init__(self, tokens: torch.Tensor, seqs: list[Sequence]) -> None:
        self.tokens = tokens  # [S] int64 on the device
        self._row = {id(seq): row for row, seq in enumerate(seqs)}

    def index_of(self, seq: Sequence, position: int) -> int:
        """The row of the token at `position` of `seq` among the tokens in flight, or -1 if it is known."""
        if seq.tokens[position] >= 0:
            return -1
        return self._row[id(seq)]

    def fill(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [n] with each entry whose row is >= 0 replaced by that token in flight."""
        return torch.where(rows >= 0, self.tokens[rows.clamp(min=0)], ids)
