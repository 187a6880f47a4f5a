"""The device's busy share while a measurement runs, sampled on a thread of its own.

On CUDA: NVML's utilisation rate, the share of each sample period (1/6 s to 1 s, by GPU) in which
at least one kernel ran, read through the driver's libnvidia-ml (no Python package needed),
averaged over the measurement. On the CPU (the dry run) the stand-in is this process's CPU time
over its torch threads' wall time. `source` says which, or why there is none.

    with BusySampler(device) as busy:
        run()
    busy.share  # 0..1, or None
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from types import TracebackType

import torch


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


def nvml_reader(device: torch.device):  # noqa: ANN201 - a () -> float, or None
    """A function returning the GPU's utilisation now (0..1), found by its PCI bus id, or None."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        props = torch.cuda.get_device_properties(device)
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus_id), ctypes.byref(handle)) != 0:
            return None
    except (OSError, AttributeError, RuntimeError):
        return None

    def read() -> float:
        util = _Utilization()
        if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) != 0:
            raise RuntimeError("nvmlDeviceGetUtilizationRates failed")
        return util.gpu / 100.0

    try:
        read()
    except RuntimeError:
        return None
    return read


def cpu_reader():  # noqa: ANN201 - a () -> float
    """The process's CPU time over its torch threads' wall time since the previous call (0..1)."""
    last = [time.perf_counter(), time.process_time()]
    threads = max(torch.get_num_threads(), 1)

    def read() -> float:
        wall, cpu = time.perf_counter(), time.process_time()
        share = (cpu - last[1]) / max((wall - last[0]) * threads, 1e-9)
        last[:] = [wall, cpu]
        return min(share, 1.0)

    return read


class BusySampler:
    def __init__(self, device: torch.device, period_s: float = 0.1) -> None:
        self.period_s = period_s
        if device.type == "cuda":
            self._read = nvml_reader(device)
            self.source = "nvml utilization" if self._read is not None else "unavailable (no libnvidia-ml)"
        else:
            self._read, self.source = cpu_reader(), "process CPU time / torch threads (CPU stand-in)"
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        assert self._read is not None
        while not self._stop.wait(self.period_s):
            try:
                self.samples.append(self._read())
            except RuntimeError:
                return

    def __enter__(self) -> BusySampler:
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, name="busy-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if self._read is not None and not self.samples:
                with contextlib.suppress(RuntimeError):  # NOTE: shorter than one period: one sample at the end
                    self.samples.append(self._read())

    @property
    def share(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    def figures(self) -> dict[str, object]:
        return {"gpu_busy_share": self.share, "busy_source": self.source, "busy_samples": len(self.samples)}
