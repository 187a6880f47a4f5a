"""The GPU check's first step: every module the later steps import, and the GPU, in seconds.

A bare GPU machine may lack one of them; finding that out after the checkpoint and the checks
have run would waste the lease. Prints each module's version and exits 1 naming every missing
one (and, without --dry-run, when no CUDA device is visible).

    python benchmarks/gpu_env_check.py [--dry-run]
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

# What hpcinfer imports at run time, and what the checks compare against.
REQUIRED = (
    "torch",
    "numpy",
    "pyarrow",
    "tokenizers",
    "safetensors",
    "click",
    "rich",
    "tqdm",
    "jinja2",
    "transformers",
    "sentence_transformers",
)


def _version(module: str) -> str:
    try:
        return metadata.version(module.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return ""


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    missing = []
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is a missing module here
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        print(f"{name} {_version(name)}".rstrip())
    print(f"python {sys.version.split()[0]}")
    if missing:
        print("missing: " + "; ".join(missing))
        return 1
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if dry:
        return 0
    if not torch.cuda.is_available():
        print("missing: a CUDA device")
        return 1
    print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
