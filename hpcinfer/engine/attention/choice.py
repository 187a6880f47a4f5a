"""Which attention implementation a run uses, chosen once at start-up: what `--attention` asks for,
and what can run here (flash-attn's paged kernel, the Triton kernel, or the pure-torch path).

Each kernel's reasons it cannot run (`flash_attn_problem`, `triton_problem`) are plain strings,
so `--attention triton` on a host without a compiler fails at start-up with the reason, not at the
first decode step.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sysconfig
from pathlib import Path

import torch

from ...errors import ConfigError
from ..kvcache.pools import KVCache, KVLayout
from .paged import FlashAttnPagedAttention, TorchPagedAttention, TritonPagedAttention

ATTENTION_KINDS = ("auto", "torch", "flash-attn", "triton")
FLASH_ATTN_BLOCK = 256  # flash-attn 2 pages: page_block_size must be a multiple of 256
SINKS = "does not run attention sinks (gpt-oss): they run --attention triton or torch"


def flash_attn_problem(layout: KVLayout, device: torch.device) -> str | None:
    """Why flash-attn's paged kernel cannot run this cache on `device`, or None when it can."""
    if device.type != "cuda":
        return f"needs a CUDA device (the run is on {device})"
    if layout.quantized:
        return "does not read an FP8 KV cache (--kv-cache-dtype fp8 runs --attention torch)"
    if layout.sinks:
        return SINKS
    if layout.dtype not in (torch.float16, torch.bfloat16):
        return f"runs float16 or bfloat16, not {str(layout.dtype).removeprefix('torch.')} (--dtype)"
    if layout.block_size % FLASH_ATTN_BLOCK:
        return f"needs --kv-block-size a multiple of {FLASH_ATTN_BLOCK} (got {layout.block_size})"
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return "the flash-attn package is not installed (pip install flash-attn)"
    if layout.softcap and "softcap" not in inspect.signature(flash_attn_with_kvcache).parameters:
        return "caps attention scores (Gemma 2) from flash-attn 2.6 on: this one has no softcap"
    return None


def triton_build_problem() -> str | None:
    """Why Triton could not build the C launcher it compiles at its first kernel launch, or None.

    NOTE: Triton's own search (triton/runtime/build.py): $CC, else gcc, else clang on PATH, and
    Python.h in the interpreter's include directory. Without them the failure comes at the first
    decode step, long after start-up, as a compiler error; here it is known before the run.
    """
    import triton

    if getattr(getattr(getattr(triton, "knobs", None), "build", None), "impl", None) is not None:
        return None  # a custom build function stands in for the compiler
    cc = os.environ.get("CC")
    if cc:
        if shutil.which(cc) is None:
            return f"needs a C compiler to build its launcher at the first launch: CC={cc} is not found"
    elif shutil.which("gcc") is None and shutil.which("clang") is None:
        return "needs a C compiler to build its launcher at the first launch (no gcc or clang on PATH; set CC)"
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # as Triton resolves it
    include = Path(sysconfig.get_paths(scheme=scheme)["include"])
    if not (include / "Python.h").is_file():
        return f"needs Python's C headers to build its launcher (no Python.h in {include}: install python3-dev)"
    return None


def triton_problem(layout: KVLayout, device: torch.device) -> str | None:
    """Why the Triton kernel cannot run this cache on `device`, or None when it can."""
    if device.type != "cuda":
        return f"needs a CUDA device (the run is on {device}; on the CPU Triton only interprets)"
    if layout.quantized:
        return "does not read an FP8 KV cache (--kv-cache-dtype fp8 runs --attention torch)"
    size = layout.block_size
    if size & (size - 1):
        return f"needs --kv-block-size a power of two (got {size})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (it comes with torch's CUDA builds)"
    return triton_build_problem()


def attention_kind(kind: str, layout: KVLayout, device: torch.device) -> str:
    """What `--attention kind` runs here: torch, flash-attn or triton.

    auto takes, on CUDA, flash-attn where it can run (a half dtype, blocks of 256, the package
    installed), else the Triton kernel (blocks a power of two, triton installed, a C compiler and
    Python's headers for its launcher), and the pure-torch path everywhere else; both kernels read
    K/V blocks in place. Asking for a kernel where it cannot run is a ConfigError that says why.
    """
    if kind not in ATTENTION_KINDS:
        raise ConfigError(f"--attention must be one of {', '.join(ATTENTION_KINDS)} (got {kind!r})")
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        return "torch"
    for name, problem in (("flash-attn", flash_attn_problem), ("triton", triton_problem)):
        if kind in ("auto", name):
            why = problem(layout, device)
            if why is None:
                return name
            if kind == name:
                raise ConfigError(f"--attention {name} {why}")
    return "torch"


PagedAttention = TorchPagedAttention | FlashAttnPagedAttention | TritonPagedAttention


def choose_attention(cache: KVCache, device: torch.device, kind: str = "auto", timed: bool = False) -> PagedAttention:
    """The attention implementation for this run, chosen once (`attention_kind`)."""
    name = attention_kind(kind, cache.layout, device)
    if name == "flash-attn":
        from flash_attn import flash_attn_with_kvcache

        return FlashAttnPagedAttention(cache, flash_attn_with_kvcache)
    if name == "triton":
        return TritonPagedAttention(cache)
    return TorchPagedAttention(cache, timed=timed)
