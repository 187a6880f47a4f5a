"""Which int8 kernels a run may use on this CPU: each checked for accuracy first, then the fastest.

Accuracy comes first: on x86 CPUs without int8 dot-product instructions (VNNI, AMX), a kernel may
add pairs of uint8 x int8 products in 16 bits (`vpmaddubsw`), which saturates on 8-bit activations
(oneDNN on AVX2 or AVX-512 without VNNI: 14x the rounding error). So each kernel (int8.Int8Kernel)
is first checked against float32 on a probe built to saturate (`probe_kernels`), and its error must
stay within what int8 rounding predicts (`rounding_error`); a library that fails at 8 bits is tried
with 7-bit activations (`reduce_range`, torch's own guard on such CPUs), and a kernel that fails
both is never used. Only then does speed choose: `pick_kernel` times the accurate candidates on the
model's own largest layer at the row count the job will run, and keeps the first in the libraries'
order unless another is faster by KERNEL_MARGIN: two kernels round differently, so a choice that
followed noise would give one command different answers from run to run. A run decides once
(`settled_int8`), records the kernel's name in its report and its resume fingerprint, and passes
it on (`Int8Kernel.parse`), so every process of the run, and a resumed run, computes the same way.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from .int8 import ENGINES, Int8Kernel, Int8Linear

if TYPE_CHECKING:
    from ..config import DeviceConfig


def available_engines() -> list[str]:
    supported = set(torch.backends.quantized.supported_engines)
    return [e for e in ENGINES if e in supported]


@functools.cache
def _cpuinfo_field(key: str) -> str:
    """A field of the first CPU /proc/cpuinfo lists (Linux), "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            fields = (line.split(":", 1) for line in info if ":" in line)
            return next((value.strip() for name, value in fields if name.strip() == key), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux), empty where they cannot be read."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"), "" where unknown."""
    return _cpuinfo_field("vendor_id")


def cpu_has_bfloat16() -> bool:
    """Whether this CPU computes in bfloat16 itself (AVX-512 BF16 or AMX's bfloat16 tiles)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_vnni() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX-INT8)."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


INT8_INSTRUCTIONS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products that accumulate in 32 bits


def missing_int8_instructions() -> str:
    """A phrase naming what this CPU lacks for int8 (for messages), "" where it has one of them."""
    if cpu_has_vnni():
        return ""
    return f"this CPU has none of {', '.join(INT8_INSTRUCTIONS)}"


def rounding_error(x: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor, reduce_range: bool) -> float:
    """The relative error (norm of the difference over the norm of `reference`) that int8 rounding
    alone gives `x @ weight.T`: activations on one uint8 grid per call (255 or, 7-bit, 127 steps
    over [min(x, 0), max(x, 0)]), each weight row on a symmetric grid of 127 steps a side.

    NOTE: each rounding is uniform within half a step, variance step^2 / 12, and independent, so
    output (i, j) has variance sum_k(w_jk^2) s_x^2 / 12 + sum_k(x_ik^2) s_wj^2 / 12. This is the
    kernel's documented accuracy: a kernel that accumulates exactly (int32) lands within a few
    percent of it; one that saturates lands far above it.
    """
    x = x.detach().reshape(-1, x.shape[-1]).double()
    w = weight.detach().double()
    step_x = (x.max().clamp(min=0) - x.min().clamp(max=0)) / (127 if reduce_range else 255)
    step_w = w.abs().amax(dim=1) / 127
    variance = (step_x**2 / 12) * (w**2).sum(1)[None, :] + (x**2).sum(1)[:, None] * (step_w**2 / 12)[None, :]
    return float((variance.sum() / (reference.detach().double() ** 2).sum()).sqrt())


ROUNDING_SLACK = 1.5  # an accurate kernel's error over rounding_error (measured 1.00 +- 0.02; saturation: 14x)
# NOTE: timings of two kernels on one layer vary by a few percent run to run; a kernel takes over from
# the first accurate one only when it is this much faster, so a near tie always goes the same way
KERNEL_MARGIN = 0.15


@dataclass(frozen=True, slots=True)
class KernelProbe:
    """One kernel's error on the saturation probe against float32, and int8 rounding's prediction."""

    kernel: Int8Kernel
    error: float
    bound: float

    @property
    def accurate(self) -> bool:
        return self.error <= ROUNDING_SLACK * self.bound


def probe_kernel(kernel: Int8Kernel) -> KernelProbe:
    """`kernel` on an input built to saturate 16-bit pair sums: every activation in the upper half
    of its grid and weights near full scale, so two products of one sign exceed 2^15 (a 64-row
    call and a one-row call, the batch and the decode shapes)."""
    generator = torch.Generator().manual_seed(0)
    x = 0.5 + 0.5 * torch.rand(65, 256, generator=generator)
    signs = torch.randint(0, 2, (256, 256), generator=generator) * 2 - 1
    weight = signs * (0.5 + 0.5 * torch.rand(256, 256, generator=generator))
    layer = Int8Linear(weight, None, kernel)
    reference = x @ weight.T
    error = max(
        float((layer(x[:64]) - reference[:64]).norm() / reference[:64].norm()),
        float((layer(x[64:]) - reference[64:]).norm() / reference[64:].norm()),
    )
    bound = max(
        rounding_error(x[:64], weight, reference[:64], kernel.reduce_range),
        rounding_error(x[64:], weight, reference[64:], kernel.reduce_range),
    )
    return KernelProbe(kernel, error, bound)


@functools.cache
def probe_kernels() -> tuple[KernelProbe, ...]:
    """Every library at 8 bits, and at 7 bits where 8 is not accurate (once a process, ~10 ms)."""
    probes = []
    for engine in available_engines():
        probe = probe_kernel(Int8Kernel(engine))
        probes.append(probe)
        if not probe.accurate:
            probes.append(probe_kernel(Int8Kernel(engine, reduce_range=True)))
    return tuple(probes)


def accurate_kernels() -> list[Int8Kernel]:
    """The kernels whose error on the probe is int8 rounding's, one per library (8 bits first)."""
    found: dict[str, Int8Kernel] = {}
    for probe in probe_kernels():
        if probe.accurate and probe.kernel.engine not in found:
            found[probe.kernel.engine] = probe.kernel
    return list(found.values())


def probe_summary() -> str:
    """The probe's findings, for messages: `onednn 0.141 (bound 0.010)`, ..."""
    return ", ".join(f"{p.kernel.name} error {p.error:.3f} (int8 rounding {p.bound:.3f})" for p in probe_kernels())


def pick_kernel(weight: torch.Tensor, rows: int, kernels: list[Int8Kernel] | None = None) -> Int8Kernel:
    """Of the accurate kernels (or `kernels`, in order of preference), the first, unless another
    multiplies `rows` rows by `weight` faster by KERNEL_MARGIN on this CPU, timed here.

    NOTE: the kernels take turns, five rounds, and each keeps its best time, so a busy moment
    on the machine cannot decide the choice by landing on one kernel's runs only.
    """
    kernels = accurate_kernels() if kernels is None else kernels
    if not kernels:
        raise RuntimeError(no_accurate_kernel())
    if len(kernels) == 1:
        return kernels[0]
    # NOTE: past 2,048 rows the ranking no longer changes, only the cost of finding it (1 s at 8,192)
    x = torch.randn(min(max(1, rows), 2048), weight.shape[1])
    layers = {kernel: Int8Linear(weight, None, kernel) for kernel in kernels}
    for layer in layers.values():
        layer(x)  # the first call builds the kernel
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(5):
        for kernel, layer in layers.items():
            start = time.perf_counter()
            layer(x)
            best[kernel] = min(best[kernel], time.perf_counter() - start)
    return preferred(kernels, best)


def preferred(kernels: list[Int8Kernel], seconds: dict[Int8Kernel, float]) -> Int8Kernel:
    """The first of `kernels`, unless another took under (1 - KERNEL_MARGIN) of its `seconds`: then
    the fastest."""
    fastest = min(kernels, key=seconds.__getitem__)
    return fastest if seconds[fastest] < (1 - KERNEL_MARGIN) * seconds[kernels[0]] else kernels[0]


def candidate_kernels(name: str = "auto") -> list[Int8Kernel]:
    """The kernels a run may use: the one `name` (--int8-kernel) gives, refused if it fails the
    accuracy probe here, else ("auto") every accurate one."""
    if name == "auto":
        return accurate_kernels()
    named = Int8Kernel.parse(name)
    if named.engine not in available_engines():
        raise ConfigError(f"--int8-kernel {named.name}: this torch build has no {named.engine} engine")
    probe = next((p for p in probe_kernels() if p.kernel == named), None) or probe_kernel(named)
    if not probe.accurate:
        missing = missing_int8_instructions()
        raise ConfigError(
            f"--int8-kernel {named.name} is not accurate on this CPU: error {probe.error:.3f} against int8 "
            f"rounding's {probe.bound:.3f} on the probe{'; ' + missing if missing else ''}"
        )
    return [named]


def settle_kernel(name: str, shape: tuple[int, int], rows: int) -> Int8Kernel:
    """One kernel for every process of a run: `name` checked, or the fastest accurate kernel timed
    on a weight of `shape` (the model's largest layer: timing does not depend on the values)."""
    kernels = candidate_kernels(name)
    if not kernels:
        raise ConfigError(f"--quantize int8: {no_accurate_kernel()}")
    generator = torch.Generator().manual_seed(0)
    return pick_kernel(torch.randn(*shape, generator=generator) * 0.02, rows, kernels)


def settled_int8(device: DeviceConfig, model_config: object, rows: int) -> DeviceConfig:
    """Under --quantize int8, the device options with the one kernel every process of the run is
    given (--int8-kernel as a name): the one named, checked, or the fastest accurate kernel timed on
    a weight of the model's largest layer (hidden_size x intermediate_size); any other as they are."""
    if device.quantize != "int8":
        return device
    hidden = int(getattr(model_config, "hidden_size", 0) or 768)
    intermediate = int(getattr(model_config, "intermediate_size", 0) or 4 * hidden)
    kernel = settle_kernel(device.int8_kernel, (intermediate, hidden), rows)
    return replace(device, int8_kernel=kernel.name)


def resumed_int8(device: DeviceConfig, recorded: dict[str, Any]) -> DeviceConfig:
    """`--resume`: the weights and int8 kernel the output began with, where the run leaves them to
    hpcinfer (`--quantize auto`, `--int8-kernel auto`): rows of one output are computed one way.
    A kernel named otherwise than the recorded one is refused by the fingerprint, naming both."""
    if device.quantize == "auto":
        device = replace(device, quantize="int8" if recorded.get("quantize") == "int8" else "none")
    if device.quantize == "int8" and device.int8_kernel == "auto" and recorded.get("int8_kernel"):
        device = replace(device, int8_kernel=str(recorded["int8_kernel"]))
    return device


def no_accurate_kernel() -> str:
    missing = missing_int8_instructions()
    return f"no int8 kernel is accurate on this CPU ({probe_summary()}){'; ' + missing if missing else ''}"


def int8_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int8 weights cannot run here, or None."""
    if device.type != "cpu":
        return f"--quantize int8 runs on the CPU (on {device.type} use --quantize fp8 or --dtype bfloat16)"
    if dtype != torch.float32:
        return f"--quantize int8 computes around float32 activations (got --dtype {str(dtype).removeprefix('torch.')})"
    if not available_engines():
        return "this torch build has no quantized CPU engine (FBGEMM or oneDNN)"
    if not accurate_kernels():
        return f"--quantize int8: {no_accurate_kernel()}"
    return None


__all__ = [
    "INT8_INSTRUCTIONS",
    "KERNEL_MARGIN",
    "ROUNDING_SLACK",
    "KernelProbe",
    "accurate_kernels",
    "available_engines",
    "candidate_kernels",
    "cpu_flags",
    "cpu_vendor",
    "cpu_has_bfloat16",
    "cpu_has_vnni",
    "int8_problem",
    "missing_int8_instructions",
    "no_accurate_kernel",
    "pick_kernel",
    "preferred",
    "probe_kernel",
    "probe_kernels",
    "probe_summary",
    "resumed_int8",
    "rounding_error",
    "settle_kernel",
    "settled_int8",
]
