"""The GPU check's first step: every module the later steps import, the GPU, and what the machine
brings, in seconds.

A bare GPU machine may lack one of them; finding that out after the checkpoint and the checks
have run would waste the lease. Prints each module's version and exits 1 naming every missing
one (and, without --dry-run, when no CUDA device is visible). Records, in --json:
- versions: python, every module, torch's CUDA and cuDNN, NCCL, Triton;
- the GPUs (name, compute capability, memory) and the driver, with persistence mode, clocks and
  power limit as nvidia-smi reports them (a GPU without persistence mode pays its driver's start
  at every process, and its first kernels run at idle clocks);
- what Triton needs at its first launch: a C compiler and Python's headers (without them
  `--attention auto` runs the torch path and `--attention triton` is refused, naming them);
- the tokenizer's parallelism: TOKENIZERS_PARALLELISM as set, and the cores a batch encode kept
  busy (the Rust thread pool, which tokenizing the corpus relies on).

    python benchmarks/gpu_check/gpu_env_check.py [--dry-run] [--json env.json]
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # NOTE: runs from a checkout, installed or not

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
SMI_FIELDS = "name,driver_version,persistence_mode,clocks.max.sm,clocks.sm,memory.total,power.limit,pstate"


def _version(module: str) -> str:
    try:
        return metadata.version(module.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return ""


def nvidia_smi() -> list[dict[str, str]] | str:
    """One dict a GPU (SMI_FIELDS), or why there is none."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    if done.returncode:
        return f"nvidia-smi exit {done.returncode}: {done.stderr.strip()[:200]}"
    keys = SMI_FIELDS.split(",")
    return [dict(zip(keys, (v.strip() for v in line.split(",")), strict=False)) for line in done.stdout.splitlines()]


def build_tools() -> dict[str, Any]:
    """The C compiler and Python headers Triton builds its launcher with, as Triton looks for them."""
    from hpcinfer.engine.attention.choice import triton_build_problem

    include = Path(sysconfig.get_paths()["include"])
    return {
        "CC": os.environ.get("CC"),
        "gcc": shutil.which("gcc"),
        "clang": shutil.which("clang"),
        "python_headers": str(include / "Python.h") if (include / "Python.h").is_file() else None,
        "triton_can_build": triton_build_problem(),  # None: it can
    }


def tokenizer_parallelism() -> dict[str, Any]:
    """TOKENIZERS_PARALLELISM, and the cores a batch encode of the sample corpus kept busy."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    texts = pq.read_table(REPO / "sample_data" / "requests.parquet", columns=["text"]).column("text").to_pylist()
    tokenizer = Tokenizer.from_file(str(REPO / "benchmarks" / "minilm_tokenizer" / "tokenizer.json"))
    texts = texts * 2
    wall, cpu = time.perf_counter(), time.process_time()
    tokenizer.encode_batch(texts)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "unset (on)"),
        "RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS"),
        "rows": len(texts),
        "encode_s": wall,
        "cores_busy": cpu / wall if wall > 0 else None,
        "cpu_count": os.cpu_count(),
    }


def gpus() -> list[dict[str, Any]]:
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(
            {
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": props.total_memory / 2**30,
                "multiprocessors": props.multi_processor_count,
            }
        )
    return out


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    out = Path(argv[argv.index("--json") + 1]) if "--json" in argv else None
    missing, versions = [], {}
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is a missing module here
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        versions[name] = _version(name)
        print(f"{name} {versions[name]}".rstrip())
    print(f"python {sys.version.split()[0]}")
    if missing:
        print("missing: " + "; ".join(missing))
        return 1
    import torch

    from benchmarks.gpu_check.gpu_results import write_json

    env: dict[str, Any] = {"python": sys.version.split()[0], "modules": versions, "dry_run": dry}
    env |= {
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {env['triton']}")
    env["build_tools"] = build_tools()
    why = env["build_tools"]["triton_can_build"]
    print(f"Triton's launcher build: {'ok' if why is None else why}")
    env["tokenizer"] = tokenizer_parallelism()
    tok = env["tokenizer"]
    print(
        f"tokenizer: TOKENIZERS_PARALLELISM={tok['TOKENIZERS_PARALLELISM']}, {tok['rows']:,} rows in "
        f"{tok['encode_s']:.2f} s, {tok['cores_busy']:.1f} cores busy of {tok['cpu_count']}"
    )
    env["nvidia_smi"] = nvidia_smi() if not dry else "not queried (--dry-run)"
    if torch.cuda.is_available():
        env["gpus"] = gpus()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    env["gpu_count"] = torch.cuda.device_count()
    if isinstance(env["nvidia_smi"], list):
        for gpu in env["nvidia_smi"]:
            print("GPU: " + ", ".join(f"{k} {v}" for k, v in gpu.items()))
    else:
        print(f"nvidia-smi: {env['nvidia_smi']}")
    if out is not None:
        write_json(out, env)
    if dry:
        return 0
    if not torch.cuda.is_available():
        print("missing: a CUDA device")
        return 1
    print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
