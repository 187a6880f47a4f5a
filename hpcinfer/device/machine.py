"""What the machine a run ran on is, for the report's heading: the CPU (model, cores, the vector
flags that decide which kernels run), the GPUs, and the versions of what ran."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

from . import accelerators

VECTOR_FLAG_PREFIXES = ("avx", "amx", "fma", "sse4", "f16c", "vnni")
VERSIONS_OF = ("hpcinfer", "torch", "transformers", "sentence-transformers", "tokenizers", "pyarrow", "ray")


def cpu_model_and_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """("Intel(R) Xeon(R) ...", ["avx2", "avx512f", ...]); empty where /proc/cpuinfo cannot be read."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = [f for f in value.split() if f.startswith(VECTOR_FLAG_PREFIXES)]
                    break
    except OSError:
        pass
    return model, sorted(flags)


def machine_facts() -> dict[str, Any]:
    model, flags = cpu_model_and_flags()
    gpus = [accelerators.cuda_properties(i).name for i in range(accelerators.cuda_count())]
    versions = {"python": platform.python_version()}
    for name in VERSIONS_OF:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "cpu": model,
        "cpu_flags": flags,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpus": gpus,
        "os": platform.platform(terse=True),
        "versions": versions,
    }
