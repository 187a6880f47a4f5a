"""Which devices a run uses: `--devices` parsed and validated, each made once, each given a label."""

from __future__ import annotations

import torch

from ..config import DeviceConfig
from ..device import Device, accelerators, make_device
from ..errors import ConfigError


def parse_devices(spec: str, cuda_count: int | None = None) -> list[str]:
    """'cuda:0,cuda:1' | 'all' | 'cpu,cpu' -> one spec per replica, validated.

    A CUDA device may appear once (two replicas on one GPU would only compete for it); CPU
    replicas may repeat: they split the CPU's threads between them.
    """
    count = accelerators.cuda_count() if cuda_count is None else cuda_count
    if spec.strip() == "all":
        if not count:
            raise ConfigError("--devices all: no CUDA device is available (try --devices cpu)")
        return [f"cuda:{i}" for i in range(count)]
    specs = [s.strip() for s in spec.split(",") if s.strip()]
    if not specs:
        raise ConfigError("--devices: no device given")
    normalized = [("cuda:0" if s == "cuda" else s) for s in specs]
    for s in normalized:
        if s.startswith("cuda") and normalized.count(s) > 1:
            raise ConfigError(f"--devices: {s} is listed {normalized.count(s)} times; one replica per GPU")
        if not (s in ("cpu", "simulated") or s.startswith("cuda:")):
            raise ConfigError(f"--devices: {s!r} is not a device (expected cuda:N, cpu or all)")
    return normalized


def device_labels(specs: list[str]) -> list[str]:
    """Names that tell replicas apart: cuda:1 stays cuda:1, a repeated cpu becomes cpu#0, cpu#1."""
    return [s if specs.count(s) == 1 else f"{s}#{specs[:i].count(s)}" for i, s in enumerate(specs)]


def make_devices(specs: list[str], streams: int, threads: int | None) -> list[Device]:
    """The devices, made once; CPU replicas share the machine's threads (or --threads) equally."""
    cpus = specs.count("cpu")
    total = threads or torch.get_num_threads()
    devices: list[Device] = []
    try:
        for s in specs:
            if s == "cpu" and cpus > 1:
                from ..device.cpu import CpuDevice

                devices.append(CpuDevice(streams, threads=max(1, total // cpus)))
            else:
                devices.append(make_device(s, streams))
    except BaseException:
        for d in devices:
            d.close()
        raise
    return devices


def make_run_devices(device: DeviceConfig) -> list[Device]:
    """The run's devices: `--devices` (one replica each), or else the one `--device`."""
    if not device.devices:
        return [make_device(device.device, device.streams)]
    return make_devices(parse_devices(device.devices), device.streams, device.threads)
