"""Int8 weights for CPU linear layers: `--quantize int8`'s layer (`Int8Linear`) and its kernel (`Int8Kernel`).

Each weight is stored as int8 with one scale per output channel (its row's largest magnitude maps
to 127), a quarter of float32's bytes. A forward quantizes the activations on the fly (one uint8
scale and zero point per call, from the batch's range) and multiplies int8 by int8 into int32 with
torch's quantized CPU kernels: FBGEMM or oneDNN, which use the CPU's int8 dot-product instructions
(AVX-512 VNNI, AMX) where it has them. Output is float32, as a float32 linear's.

A kernel is a library and an activation width (`Int8Kernel`); which kernels are accurate on this
CPU, and which is fastest, is int8_kernels.py's; a model's layers swapped for these is
int8_quantize.py's.

NOTE: torch marks its eager quantization front-end (`torch.ao.quantization`) as deprecated in
favour of torchao; the kernels used here (`quantized::linear_prepack` / `linear_dynamic`) are the
core operators underneath both. torchao's CPU int8 path multiplies with `torch._int_mm`, which
measured slower than float32 at embedding shapes on an AMX CPU, so these operators are called
directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .bert import bucket_rows

ENGINES = ("onednn", "fbgemm")  # torch's quantized CPU kernel libraries, tried in this order


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
    where per-channel weight scales absorb them (int8_quantize.smoothing).
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
        # int8 weight by bfloat16 activations instead (int8_quantize.weight_only_rows): a second copy of
        # the int8 weight, in the layout that kernel reads.
        self.weight_only_rows = weight_only_rows
        if weight_only_rows:
            self.qweight = quantized.int_repr().contiguous()
            self.qscale = quantized.q_per_channel_scales().to(torch.bfloat16)
        # NOTE: whether 8-bit activations are safe is the kernel's (measured: int8_kernels.probe_kernels)
        self.reduce_range = kernel.reduce_range

    @classmethod
    def from_linear(cls, linear: nn.Module, kernel: Int8Kernel | str, smooth: torch.Tensor | None = None) -> Int8Linear:
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


__all__ = [
    "ENGINES",
    "Int8Kernel",
    "Int8Linear",
    "as_kernel",
    "quantize_channels",
    "quantized_engine",
]
