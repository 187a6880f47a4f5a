"""CUDA graphs for the forward: captured once per (stream, rows bucket, padded length), replayed after.

A batch is padded up to the nearest captured shape: rows to the next power of two (capped at the
row limit), length as planned (already a multiple of pad_multiple). Padding rows get length 1 and
their outputs are dropped. Each compute stream has its own graphs and static buffers, so two
streams never replay into the same memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


def rows_bucket(n: int, max_rows: int) -> int:
    return min(max_rows, 1 << max(n - 1, 0).bit_length())


class _Captured:
    def __init__(self, forward: Forward, rows: int, width: int, device: torch.device) -> None:
        self.ids = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.lengths = torch.ones(rows, dtype=torch.int32, device=device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, cuBLAS handles)
            for _ in range(2):
                forward(self.ids, self.lengths, True)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = forward(self.ids, self.lengths, True)


class GraphRunner:
    """Drop-in for the model call on CUDA: same inputs, same [rows, dim] output."""

    def __init__(self, forward: Forward, max_rows: int, device: torch.device) -> None:
        self.forward = forward
        self.max_rows = max_rows
        self.device = device
        self._graphs: dict[tuple[int, int, int], _Captured] = {}

    def __call__(self, stream_index: int, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n, width = ids.shape
        key = (stream_index, rows_bucket(n, self.max_rows), width)
        captured = self._graphs.get(key)
        if captured is None:
            # NOTE: capture runs on its own stream; make it wait for this stream's work so far.
            captured = self._graphs[key] = _Captured(self.forward, key[1], width, self.device)
        captured.ids[:n].copy_(ids)
        captured.lengths[:n].copy_(lengths)
        if n < key[1]:
            captured.ids[n:].zero_()
            captured.lengths[n:].fill_(1)
        captured.graph.replay()
        return captured.out[:n]

    @property
    def captured_shapes(self) -> list[tuple[int, int, int]]:
        return sorted(self._graphs)
