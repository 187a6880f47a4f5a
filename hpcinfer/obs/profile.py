"""Profiling support: NVTX ranges around every stage step, and a torch.profiler trace.

Ranges are named like `hpcinfer/execute batch=17 rows=64 tokens=8192` and pushed on the thread
that does the work, so Nsight Systems shows each stage on its own thread row. The `nvtx` package
is a no-op unless a profiler is attached, so this runs on CPU too. It is optional (the `profile`
extra): only `hpcinfer profile` needs it, and says how to install it when it is missing.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import ConfigError


class RangeBackend(Protocol):
    def push(self, name: str) -> None: ...

    def pop(self) -> None: ...


def range_name(stage: str, args: dict[str, Any]) -> str:
    parts = [f"{k}={args[k]}" for k in ("batch", "block", "rows", "tokens") if k in args]
    return " ".join([f"hpcinfer/{stage}", *parts])


class NvtxRanges:
    """The nvtx package's ranges, plus torch.cuda.nvtx on CUDA (both per calling thread)."""

    def __init__(self, cuda: bool) -> None:
        try:
            import nvtx
        except ImportError:
            raise ConfigError(
                "hpcinfer profile needs the nvtx package: pip install 'hpcinfer[profile]' (or pip install nvtx)"
            ) from None

        self._nvtx = nvtx
        self._cuda = None
        if cuda:
            import torch

            self._cuda = torch.cuda.nvtx

    def push(self, name: str) -> None:
        self._nvtx.push_range(name, domain="hpcinfer")
        if self._cuda is not None:
            self._cuda.range_push(name)

    def pop(self) -> None:
        if self._cuda is not None:
            self._cuda.range_pop()
        self._nvtx.pop_range(domain="hpcinfer")


class RecordingRanges:
    """Records (thread, 'push'|'pop', name) events; for tests."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def push(self, name: str) -> None:
        with self._lock:
            self.events.append((threading.current_thread().name, "push", name))

    def pop(self) -> None:
        with self._lock:
            self.events.append((threading.current_thread().name, "pop", ""))


def nsys_command(argv: list[str], report: str = "hpcinfer-profile") -> str:
    """The Nsight Systems command line that captures this same job."""
    return shlex.join(
        [
            "nsys",
            "profile",
            "-t",
            "cuda,nvtx,osrt",
            "--cuda-memory-usage=true",
            "-o",
            report,
            "--force-overwrite=true",
            "hpcinfer",
            *argv,
        ]
    )


def run_profiled(
    run: Callable[..., Any], config: Any, argv: list[str], torch_profile_dir: str | None
) -> tuple[Any, list[str]]:
    """Runs the job (`run` is `api.run`) with NVTX ranges, and optionally torch.profiler; returns
    (report, notes to print)."""
    import torch

    ranges = NvtxRanges(cuda=torch.cuda.is_available() and config.device.device != "cpu")
    notes = [f"capture with Nsight Systems:\n  {nsys_command(['profile', *argv])}"]
    if torch_profile_dir is None:
        report = run(config, ranges=ranges)
    else:
        report, trace_file = _with_torch_profiler(run, config, ranges, torch_profile_dir)
        notes.append(f"torch.profiler trace: {trace_file} (open in Perfetto or chrome://tracing)")
    notes.append(f"stage trace: {config.trace_path} (open in Perfetto: https://ui.perfetto.dev)")
    return report, notes


class TorchBatchProfiler:
    """torch.profiler over a few batches, driven from the execute thread itself.

    NOTE: torch.profiler records the thread that starts it and must be stepped there, so it is
    started and stopped by the executor (skip `skip` batches, record `active`), not by the caller.
    """

    def __init__(self, trace_file: str, skip: int = 1, active: int = 3) -> None:
        self.trace_file = trace_file
        self.skip = skip
        self.active = active
        self._seen = 0
        self._prof: Any = None
        self.exported = False

    def on_batch(self) -> None:
        if self._seen == self.skip:
            self._start()
        elif self._seen == self.skip + self.active:
            self.close()
        self._seen += 1

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof.export_chrome_trace(self.trace_file)
            self._prof = None
            self.exported = True


def _with_torch_profiler(run: Callable[..., Any], config: Any, ranges: RangeBackend, directory: str) -> tuple[Any, str]:
    import os

    os.makedirs(directory, exist_ok=True)
    profiler = TorchBatchProfiler(os.path.join(directory, "torch-trace.json"))
    report = run(config, ranges=ranges, batch_profiler=profiler)
    return report, profiler.trace_file
