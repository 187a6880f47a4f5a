"""A model's linear layers swapped for int8 ones in place (`quantize_int8`), SmoothQuant-smoothed
where calibrated; a causal LM's vocabulary head too (`quantize_decoder_int8`).

The layer is int8.Int8Linear; its kernel, unless given, the fastest accurate one on the model's
largest layer (int8_kernels.pick_kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .int8 import Int8Kernel, Int8Linear, as_kernel
from .int8_kernels import cpu_has_bfloat16, pick_kernel


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
    return 4 if cpu_has_bfloat16() else 0


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
    "SMOOTH_ALPHA",
    "activation_ranges",
    "largest_weight",
    "linear_layers",
    "quantize_decoder_int8",
    "quantize_int8",
    "smoothing",
    "weight_only_rows",
]
