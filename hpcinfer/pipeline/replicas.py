"""Several devices on one machine: one replica per device, fed by one planner, drained by one writer.

A replica owns what a device needs of its own: the model's weights on it, a staging ring, compute
streams and output buffers. Batches go to the replica with the fewest outstanding tokens
(dispatch.py); the writer restores input order, so the output does not depend on which device
ran what. `DeviceLog` keeps, per device, what the report shows: batches, tokens, busy time and the
idle tail at the end of the run (how long it waited for the slowest device).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RunConfig
from ..device import Device, OutputPool, StagingRing
from ..errors import ConfigError
from ..models.checkpoint import CheckpointInfo
from ..models.registry import LoadedModel, load_model
from .execute import Executor
from .plan import TokenBudget
from .stage import StageStep

__all__ = ["DeviceLog", "Replica", "ResultWait", "build_replicas"]


class ResultWait:
    """The last step of each device's branch: waits for a result's d2h_done, then passes it on.

    NOTE: the writer takes results from every device in one queue and waits on each in turn; a
    result still running on a slow device would hold up the finished ones of a fast device behind
    it, and with them the fast device's output buffers. Waiting here, per device, sends the writer
    only finished results, so each device runs at its own pace.
    """

    name = "collect"

    def process(self, pending: Any) -> Iterator[Any]:
        if pending.out is not None:
            pending.out.events["d2h_done"].synchronize()
        yield pending

    def finish(self) -> Iterator[Any]:
        return iter(())


@dataclass(slots=True)
class _DeviceStats:
    label: str
    batches: int = 0
    rows: int = 0
    tokens: int = 0  # padded: what the device computed
    busy_ns: int = 0  # compute on its streams (event times)
    last_done_ns: int = 0


@dataclass
class DeviceLog:
    """Per-device figures, filled by the writer as results arrive (thread-safe)."""

    labels: list[str]
    stats: list[_DeviceStats] = field(init=False)

    def __post_init__(self) -> None:
        self.stats = [_DeviceStats(label) for label in self.labels]
        self._lock = threading.Lock()

    def batch_done(self, replica: int, rows: int, tokens: int, compute_ns: int, done_ns: int) -> None:
        with self._lock:
            s = self.stats[replica]
            s.batches += 1
            s.rows += rows
            s.tokens += tokens
            s.busy_ns += compute_ns
            s.last_done_ns = max(s.last_done_ns, done_ns)

    def summary(self, start_ns: int, end_ns: int) -> list[dict[str, Any]]:
        """Per device: its share of the tokens and of the wall time, and its idle tail.

        The idle tail is the time from the device's last result to the last result of any device:
        the imbalance a better dispatch would have removed.
        """
        wall = max(end_ns - start_ns, 1)
        total_tokens = sum(s.tokens for s in self.stats) or 1
        last = max((s.last_done_ns for s in self.stats), default=start_ns)
        return [
            {
                "device": s.label,
                "batches": s.batches,
                "rows": s.rows,
                "tokens": s.tokens,
                "token_share": round(s.tokens / total_tokens, 4),
                "busy_s": round(s.busy_ns / 1e9, 4),
                "busy_share": round(s.busy_ns / wall, 4),
                "finished_s": round(((s.last_done_ns or start_ns) - start_ns) / 1e9, 4),
                "idle_tail_s": round((last - (s.last_done_ns or start_ns)) / 1e9, 4),
            }
            for s in self.stats
        ]


@dataclass(slots=True)
class Replica:
    """What one device runs: its stage and execute steps, over its own ring and output buffers."""

    label: str
    device: Device
    outputs: OutputPool
    stage: StageStep
    executor: Executor


def build_replicas(
    config: RunConfig,
    devices: list[Device],
    labels: list[str],
    info: CheckpointInfo,
    dtype: torch.dtype,
    budget: TokenBudget,
    max_width: int,
    stop: threading.Event,
    batch_profiler: Any,
    preloaded: LoadedModel | None,
) -> list[Replica]:
    """One replica per device; devices that are one memory (CPU replicas) share one copy of the model."""
    plan = config.plan
    models: dict[str, LoadedModel] = {}
    replicas = []
    for i, (device, label) in enumerate(zip(devices, labels, strict=True)):
        device.bind_thread()  # NOTE: loading and graph capture below run on this device
        key = str(device.torch_device)
        if key not in models:
            models[key] = (
                preloaded if preloaded is not None and i == 0 else load_model(info, device.torch_device, dtype)
            )
        model = models[key]
        pixels = getattr(info.config, "image", None) is not None  # NOTE: an image run stages uint8 pixels
        slots = config.device.staging_buffers
        ring = StagingRing(device, slots, plan.max_batch_tokens, plan.max_batch_size, stop, pixel_dtype(pixels))
        outputs = OutputPool(
            device,
            config.device.staging_buffers + config.device.streams,
            plan.max_batch_size,
            model.embedder.output_dim,
            stop,
        )
        graphs = _graphs(config, device, model, budget, max_width)
        profiler = batch_profiler if i == 0 else None  # NOTE: torch.profiler follows one thread: the first device's
        executor = Executor(device, model.embedder, ring, outputs, graphs, budget, profiler, replica=i)
        replicas.append(Replica(label, device, outputs, StageStep(device, ring), executor))
    return replicas


def pixel_dtype(pixels: bool) -> torch.dtype:
    return torch.uint8 if pixels else torch.int32


def _graphs(config: RunConfig, device: Device, model: Any, budget: TokenBudget, max_width: int) -> Any:
    """Every graph captured here, before any stage thread starts (see device/graphs.py)."""
    if not config.device.cuda_graphs:
        return None
    if not device.supports_graphs:
        raise ConfigError("--cuda-graphs needs a CUDA device")
    from ..device.graphs import GraphRunner

    plan = config.plan
    return GraphRunner(
        device,
        model.embedder.__call__,
        max_tokens=plan.max_batch_tokens,
        max_rows=plan.max_batch_size,
        max_width=max_width,
        pad_multiple=plan.pad_multiple,
        budget_tokens=lambda: budget.tokens,
    )
