"""Int8 weights for CPU linear layers: `--quantize int8`.

Each weight is stored as int8 with one scale per output channel (its row's largest magnitude maps
to 127), a quarter of float32's bytes. A forward quantizes the activations on the fly (one uint8
scale and zero point per call, from the batch's range) and multiplies int8 by int8 into int32 with
torch's quantized CPU kernels: FBGEMM or oneDNN, which use the CPU's int8 dot-product instructions
(AVX-512 VNNI, AMX) where it has them. Output is float32, as a float32 linear's.

Which kernel library is faster depends on the CPU and on the number of rows a call multiplies
(oneDNN is far ahead on thousands of rows with AMX; FBGEMM on one or a few rows on some CPUs), so
the library is measured, not assumed: `pick_engine` times each candidate on the model's own
largest layer at the row count the job will run, once at load (a few milliseconds), and keeps the
fastest.

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

import torch
from torch import nn

from .bert import bucket_rows

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
        engine: str,
        smooth: torch.Tensor | None = None,
        weight_only_rows: int = 0,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.engine = engine
        weight = weight.detach().float()
        self.unsmooth: torch.Tensor | None = None
        if smooth is not None:
            weight = weight * smooth
            self.unsmooth = (1.0 / smooth).float()
        bias = None if bias is None else bias.detach().float().contiguous()
        self.bias = bias
        quantized = quantize_channels(weight)
        with quantized_engine(engine):
            self.packed = torch.ops.quantized.linear_prepack(quantized, bias)
        # Calls of at most `weight_only_rows` rows (a decode step of a few sequences) multiply the
        # int8 weight by bfloat16 activations instead (see `weight_only_rows`): a second copy of
        # the int8 weight, in the layout that kernel reads.
        self.weight_only_rows = weight_only_rows
        if weight_only_rows:
            self.qweight = quantized.int_repr().contiguous()
            self.qscale = quantized.q_per_channel_scales().to(torch.bfloat16)
        # NOTE: without VNNI, FBGEMM adds pairs of uint8 x int8 products in int16, which can
        # saturate; reduce_range (7-bit activations) is its guard, at a cost in precision. With
        # VNNI (and with oneDNN) products accumulate in int32.
        self.reduce_range = engine == "fbgemm" and not cpu_has_vnni()

    @classmethod
    def from_linear(cls, linear: nn.Module, engine: str, smooth: torch.Tensor | None = None) -> Int8Linear:
        return cls(linear.weight, getattr(linear, "bias", None), engine, smooth)

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


def pick_engine(weight: torch.Tensor, rows: int, engines: list[str] | None = None) -> str:
    """The kernel library that multiplies `rows` rows by `weight` fastest on this CPU, timed here.

    NOTE: the libraries take turns, five rounds, and each keeps its best time, so a busy moment
    on the machine cannot decide the choice by landing on one library's runs only.
    """
    engines = engines or available_engines()
    if not engines:
        raise RuntimeError("this torch build has no quantized CPU engine (FBGEMM or oneDNN)")
    if len(engines) == 1:
        return engines[0]
    # NOTE: past 2,048 rows the ranking no longer changes, only the cost of finding it (1 s at 8,192)
    x = torch.randn(min(max(1, rows), 2048), weight.shape[1])
    layers = {engine: Int8Linear(weight, None, engine) for engine in engines}
    for layer in layers.values():
        layer(x)  # the first call builds the kernel
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(5):
        for engine, layer in layers.items():
            start = time.perf_counter()
            layer(x)
            best[engine] = min(best[engine], time.perf_counter() - start)
    return min(engines, key=best.__getitem__)


def int8_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why int8 weights cannot run here, or None."""
    if device.type != "cpu":
        return f"--quantize int8 runs on the CPU (on {device.type} use --quantize fp8 or --dtype bfloat16)"
    if dtype != torch.float32:
        return f"--quantize int8 computes around float32 activations (got --dtype {str(dtype).removeprefix('torch.')})"
    if not available_engines():
        return "this torch build has no quantized CPU engine (FBGEMM or oneDNN)"
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
    engine: str | None = None,
    calibrate: Callable[[], object] | None = None,
    small_rows: int = 0,
) -> str:
    """Swaps the model's linear layers (`linear_layers`) for Int8Linear, in place; returns the
    kernel library, timed on the largest layer at `rows` rows unless given. `calibrate` runs the
    float model over sample inputs: each layer's activation ranges then set its smoothing."""
    layers = linear_layers(model)
    if not layers:
        raise RuntimeError("no linear layers to quantize")
    if engine is None:
        largest = max(layers, key=lambda found: found[2].weight.numel())[2]
        engine = pick_engine(largest.weight.detach(), rows)
    smooth: list[torch.Tensor | None] = [None] * len(layers)
    if calibrate is not None:
        ranges = activation_ranges([layer for _, _, layer in layers], calibrate)
        smooth = [smoothing(a, layer.weight) for a, (_, _, layer) in zip(ranges, layers, strict=True)]
    for (parent, attr, layer), factors in zip(layers, smooth, strict=True):
        setattr(parent, attr, Int8Linear(layer.weight, layer.bias, engine, factors, small_rows))
    return engine


def quantize_decoder_int8(decoder: nn.Module, rows: int) -> str:
    """A causal LM's layers and its vocabulary head in int8 (the head is the largest matmul of a
    small model's decode step; a tied head gets its own int8 copy, the embedding lookup stays float)."""
    head = decoder.lm_head if decoder.lm_head is not None else decoder.embed
    small = weight_only_rows()
    engine = quantize_int8(decoder, rows, small_rows=small)
    decoder.lm_head = Int8Linear(head.weight.detach(), None, engine, weight_only_rows=small)
    return engine


__all__ = [
    "ENGINES",
    "Int8Linear",
    "available_engines",
    "cpu_flags",
    "cpu_has_vnni",
    "int8_problem",
    "linear_layers",
    "pick_engine",
    "quantize_decoder_int8",
    "quantize_int8",
    "quantize_channels",
    "quantized_engine",
    "smoothing",
    "weight_only_rows",
]
