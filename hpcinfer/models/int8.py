"""Int8 weights for CPU linear layers: `--quantize int8`.

Each weight is stored as int8 with one scale per output channel (its row's largest magnitude maps
to 127), a quarter of float32's bytes. A forward quantizes the activations on the fly (one uint8
scale and zero point per call, from the batch's range) and multiplies int8 by int8 into int32 with
torch's quantized CPU kernels: FBGEMM or oneDNN, which use the CPU's int8 dot-product instructions
(AVX-512 VNNI, AMX) where it has them. Output is float32, as a float32 linear's.

A kernel is a library and an activation width (`Int8Kernel`). Accuracy comes first: on x86 CPUs
without int8 dot-product instructions (VNNI, AMX), a kernel may add pairs of uint8 x int8 products
in 16 bits (`vpmaddubsw`), which saturates on 8-bit activations (oneDNN on AVX2 or AVX-512 without
VNNI: 14x the rounding error). So each kernel is first checked against float32 on a probe built to
saturate (`probe_kernels`), and its error must stay within what int8 rounding predicts
(`rounding_error`); a library that fails at 8 bits is tried with 7-bit activations
(`reduce_range`, torch's own guard on such CPUs), and a kernel that fails both is never used. Only
then does speed choose: `pick_kernel` times the accurate candidates on the model's own largest
layer at the row count the job will run, once at load, and keeps the fastest. A run that starts
several processes decides once and passes the kernel's name on (`Int8Kernel.parse`), so every
process computes the same way.

NOTE: torch marks its eager quantization front-end (`torch.ao.quantization`) as deprecated in
favour of torchao; the kernels used here (`quantized::linear_prepack` / `linear_dynamic`) are the
core operators underneath both. torchao's CPU int8 path multiplies with `torch._int_mm`, which
measured slower than float32 at embedding shapes on an AMX CPU, so these operators are called
directly.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import ConfigError
from .bert import bucket_rows

if TYPE_CHECKING:
    from ..config import DeviceConfig

ENGINES = ("onednn", "fbgemm")  # torch's quantized CPU kernel libraries, tried in this order


def available_engines() -> list[str]:
    supported = set(torch.backends.quantized.supported_engines)
    return [e for e in ENGINES if e in supported]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux), empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_vnni() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX-INT8)."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


INT8_INSTRUCTIONS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products that accumulate in 32 bits


def missing_int8_instructions() -> str:
    """A phrase naming what this CPU lacks for int8 (for messages), "" where it has one of them."""
    if cpu_has_vnni():
        return ""
    return f"this CPU has none of {', '.join(INT8_INSTRUCTIONS)}"


@dataclass(frozen=True, slots=True)
class Int8Kernel:
    """One way to multiply: torch's quantized kernel library and the activations' width.

    `reduce_range`: activations quantized to 7 bits (0..127) instead of 8, so that two products
    summed in 16 bits cannot saturate (2 x 127 x 127 < 2^15), at twice the activation rounding.
    """

    engine: str  # onednn | fbgemm
    reduce_range: bool = False

    @property
    def name(self) -> str:
        return self.engine + ("-7bit" if self.reduce_range else "")

    @classmethod
    def parse(cls, name: str) -> Int8Kernel:
        engine, _, width = name.partition("-")
        if engine not in ENGINES or width not in ("", "7bit"):
            raise ValueError(f"unknown int8 kernel {name!r} (expected one of {', '.join(ENGINES)}, optionally -7bit)")
        return cls(engine, width == "7bit")


def as_kernel(kernel: Int8Kernel | str) -> Int8Kernel:
    return kernel if isinstance(kernel, Int8Kernel) else Int8Kernel.parse(kernel)


@contextmanager
def quantized_engine(engine: str) -> Iterator[None]:
    """`engine` as torch's quantized engine while weights are packed for it (packing picks the
    kernels a packed weight runs with; the global setting is restored after)."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def quantize_channels(weight: torch.Tensor) -> torch.Tensor:
    """float [out, in] -> a per-output-channel symmetric qint8 tensor."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).double()
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notice for quantized tensor types
        return torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)


class Int8Linear(nn.Module):
    """A CPU linear layer over an int8 weight with per-output-channel scales.

    `smooth` (per input channel, SmoothQuant): the activations are divided by it and the weight's
    columns multiplied by it, the same product, with activation outliers moved into the weight
    where per-channel weight scales absorb them (see `smoothing`).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: Int8Kernel | str,
        smooth: torch.Tensor | None = None,
        weight_only_rows: int = 0,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel = as_kernel(kernel)
        self.engine = kernel.engine
        weight = weight.detach().float()
        self.unsmooth: torch.Tensor | None = None
        if smooth is not None:
            weight = weight * smooth
            self.unsmooth = (1.0 / smooth).float()
        bias = None if bias is None else bias.detach().float().contiguous()
        self.bias = bias
        quantized = quantize_channels(weight)
        with quantized_engine(kernel.engine):
            self.packed = torch.ops.quantized.linear_prepack(quantized, bias)
        # Calls of at most `weight_only_rows` rows (a decode step of a few sequences) multiply the
        # int8 weight by bfloat16 activations instead (see `weight_only_rows`): a second copy of
        # the int8 weight, in the layout that kernel reads.
        self.weight_only_rows = weight_only_rows
        if weight_only_rows:
            self.qweight = quantized.int_repr().contiguous()
            self.qscale = quantized.q_per_channel_scales().to(torch.bfloat16)
        # NOTE: whether 8-bit activations are safe is the kernel's (measured: probe_kernels)
        self.reduce_range = kernel.reduce_range

    @classmethod
    def from_linear(
        cls, linear: nn.Module, kernel: Int8Kernel | str, smooth: torch.Tensor | None = None
    ) -> Int8Linear:
        return cls(linear.weight, getattr(linear, "bias", None), kernel, smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.unsmooth is not None:
            rows = rows * self.unsmooth
        m = rows.shape[0]
        if m <= self.weight_only_rows:
            out = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight, self.qscale).float()
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        if self.engine == "onednn" and m > 64:
            # NOTE: oneDNN compiles a kernel per shape; a coarse row grid bounds how many (bert.py)
            padded = bucket_rows(m)
            if padded != m:
                rows = torch.cat([rows, rows.new_zeros(padded - m, rows.shape[1])])
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)[:m]
        return out.view(*x.shape[:-1], self.out_features)


def weight_only_rows() -> int:
    """Up to how many rows a causal LM's int8 layers multiply int8 weights by bfloat16 activations
    (torch's `_weight_int8pack_mm`) rather than quantizing the activations; 0 where this CPU has
    no bfloat16 arithmetic (the kernel would emulate it).

    NOTE: measured on SmolLM2-135M, one sequence, against float32: weight-only int8 decoded 1.9x
    faster, dynamic int8 1.3x; of 100 greedy answers 25 stayed identical against 7 (quantizing
    a decoder's activations moves it further than quantizing its weights). From 16 rows up the
    weight-only kernel is slower than dynamic int8 (and than float32 at 64), so it serves small
    decode steps only.
    """
    if not hasattr(torch, "_weight_int8pack_mm"):
        return 0
    return 4 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else 0


SMOOTH_ALPHA = 0.75  # how much of an activation channel's range moves into the weight (SmoothQuant's alpha)


def smoothing(activation_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s = max|x|^alpha / max|w|^(1-alpha).

    NOTE: activations are quantized with one scale per call, so a few outlier channels (GELU's
    output in a BERT FFN, some residual channels) take most of the 256 levels and flatten the rest;
    weights have a scale per output channel and absorb the range better. alpha 0.75 kept MiniLM's
    min cosine to float32 at 0.996 on held-out rows where plain int8 reached 0.987 (0.6: 0.993,
    0.9: 0.996, 0.5: 0.968).
    """
    a = activation_max.float().clamp(min=1e-5)
    w = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=1e-5)


def activation_ranges(layers: list[nn.Module], run: Callable[[], object]) -> list[torch.Tensor]:
    """Each layer's largest input magnitude per channel while `run()` goes through the model."""
    seen: list[torch.Tensor | None] = [None] * len(layers)

    def hook(index: int) -> Callable[..., None]:
        def record(_: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            top = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            before = seen[index]
            seen[index] = top if before is None else torch.maximum(before, top)

        return record

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return [s if s is not None else torch.ones(layer.in_features) for s, layer in zip(seen, layers, strict=True)]


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
    """Of the accurate kernels (or `kernels`), the one that multiplies `rows` rows by `weight`
    fastest on this CPU, timed here.

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
    return min(kernels, key=best.__getitem__)


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


def linear_layers(model: object) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every linear layer of a batch model's transformer blocks:
    the native encoder's or decoder's layers (not the small classification head), or every
    nn.Linear of a `transformers` model."""
    roots: list[nn.Module] = []
    for name in ("encoder", "decoder"):  # SentenceEmbedder / SequenceClassifier, DecoderEmbedder
        layers = getattr(getattr(model, name, None), "layers", None)
        if isinstance(layers, nn.Module):
            roots = [layers]
    if isinstance(getattr(model, "model", None), nn.Module):  # hf_backend.HFModel
        roots = [model.model]  # type: ignore[attr-defined]
    if isinstance(model, nn.Module) and hasattr(model, "layers"):  # a bare LlamaDecoder (generation)
        roots = [model.layers]  # type: ignore[list-item]
    found = []
    for root in roots:
        for parent in root.modules():
            for attr, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    found.append((parent, attr, child))
    return found


def quantize_int8(
    model: object,
    rows: int,
    kernel: Int8Kernel | str | None = None,
    calibrate: Callable[[], object] | None = None,
    small_rows: int = 0,
) -> Int8Kernel:
    """Swaps the model's linear layers (`linear_layers`) for Int8Linear, in place; returns the
    kernel, the fastest accurate one timed on the largest layer at `rows` rows unless given.
    `calibrate` runs the float model over sample inputs: each layer's activation ranges then set
    its smoothing."""
    layers = linear_layers(model)
    if not layers:
        raise RuntimeError("no linear layers to quantize")
    if kernel is None:
        kernel = pick_kernel(largest_weight(model), rows)
    kernel = as_kernel(kernel)
    smooth: list[torch.Tensor | None] = [None] * len(layers)
    if calibrate is not None:
        ranges = activation_ranges([layer for _, _, layer in layers], calibrate)
        smooth = [smoothing(a, layer.weight) for a, (_, _, layer) in zip(ranges, layers, strict=True)]
    for (parent, attr, layer), factors in zip(layers, smooth, strict=True):
        setattr(parent, attr, Int8Linear(layer.weight, layer.bias, kernel, factors, small_rows))
    return kernel


def largest_weight(model: object) -> torch.Tensor:
    """The weight of the model's largest linear layer: where int8 kernels are timed."""
    return max((layer for _, _, layer in linear_layers(model)), key=lambda layer: layer.weight.numel()).weight.detach()


def quantize_decoder_int8(decoder: nn.Module, rows: int, kernel: Int8Kernel | str | None = None) -> Int8Kernel:
    """A causal LM's layers and its vocabulary head in int8 (the head is the largest matmul of a
    small model's decode step; a tied head gets its own int8 copy, the embedding lookup stays float)."""
    head = decoder.lm_head if decoder.lm_head is not None else decoder.embed
    small = weight_only_rows()
    kernel = quantize_int8(decoder, rows, kernel, small_rows=small)
    decoder.lm_head = Int8Linear(head.weight.detach(), None, kernel, weight_only_rows=small)
    return kernel


__all__ = [
    "ENGINES",
    "INT8_INSTRUCTIONS",
    "Int8Kernel",
    "Int8Linear",
    "KernelProbe",
    "accurate_kernels",
    "available_engines",
    "candidate_kernels",
    "cpu_flags",
    "cpu_has_vnni",
    "int8_problem",
    "largest_weight",
    "linear_layers",
    "missing_int8_instructions",
    "no_accurate_kernel",
    "pick_kernel",
    "probe_kernel",
    "probe_kernels",
    "probe_summary",
    "rounding_error",
    "settle_kernel",
    "settled_int8",
    "quantize_decoder_int8",
    "quantize_int8",
    "quantize_channels",
    "quantized_engine",
    "smoothing",
    "weight_only_rows",
]
