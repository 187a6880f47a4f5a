"""Device selection, done once at start-up. Stage code never branches on the device kind."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import Device, Event, OutputBuffer, OutputPool, StagingRing, StagingSlot, Stream
from .cpu import CpuDevice
from .simulated import SimulatedDevice

__all__ = [
    "Device",
    "Event",
    "OutputBuffer",
    "OutputPool",
    "StagingRing",
    "StagingSlot",
    "Stream",
    "dtype_for",
    "make_device",
    "resolve_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_device(spec: str, streams: int) -> Device:
    """'auto' picks CUDA when present; 'simulated' is the asynchronous test device."""
    if spec == "simulated":
        return SimulatedDevice(streams)
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return CpuDevice(streams)
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {spec}: no CUDA device is available (try --device cpu)")
        from .cuda import CudaDevice

        device = torch.device(spec)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s)")
        return CudaDevice(device if device.index is not None else torch.device("cuda:0"), streams)
    raise ConfigError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")


def resolve_dtype(spec: str, device: Device) -> torch.dtype:
    """`--dtype` for a device of the device layer (the simulated device computes on the CPU)."""
    return dtype_for(spec, device.torch_device)


def dtype_for(spec: str, device: torch.device) -> torch.dtype:
    """The one `--dtype` rule of every task and engine: 'auto' is float32 on CPU, and on CUDA
    bfloat16, or float16 on a GPU without bfloat16."""
    if spec == "auto":
        if device.type == "cuda":
            from .cuda import best_half_dtype

            return best_half_dtype(device)
        return torch.float32
    if spec not in _DTYPES:
        raise ConfigError(f"--dtype {spec!r}: expected auto, float32, bfloat16 or float16")
    return _DTYPES[spec]
