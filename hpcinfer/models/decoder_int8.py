"""A causal LM in int8, checked whole: kept only on a kernel that keeps enough of float32's greedy next
tokens over a reference text (`int8_checked`, `PROBE_TEXT`); else refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import ConfigError
from .attention import DenseCausalAttention
from .int8_kernels import candidate_kernels, missing_int8_instructions, no_accurate_kernel, pick_kernel
from .int8_quantize import quantize_decoder_int8
from .llama import LlamaDecoder

INT8_ROWS = 64  # a batched decode step's rows, for timing int8 kernel libraries (models/int8_kernels.py)


# int8 for a causal LM: the share of a reference text's next tokens whose argmax int8 keeps (int8_checked).
# NOTE: measured on SmolLM2-135M over PROBE_TEXT: 8-bit activations with 32-bit sums 0.70, 7-bit activations
# 0.49, a kernel saturating 16-bit sums 0.00; the floor sits between the first two.
TOKEN_AGREEMENT_FLOOR = 0.6
PROBE_TEXT = (
    "In 1969 two astronauts walked on the Moon while a third waited in orbit. Today scientists use telescopes "
    "in space to study distant galaxies, and engineers build rockets that land on their own. Photosynthesis "
    "lets plants turn sunlight, water and carbon dioxide into sugar and oxygen. The heart pumps blood through "
    "the body, and the lungs bring in the oxygen it carries. The capital of France is Paris. Water boils at "
    "one hundred degrees Celsius at sea level, and the Earth goes around the Sun once a year."
)


def next_tokens(model: LlamaDecoder, ids: torch.Tensor) -> torch.Tensor:
    """The model's greedy next token after each prefix of `ids`."""
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), DenseCausalAttention.of(model.cfg))
        return model.logits(hidden).argmax(-1)


def int8_checked(build_float: Callable[[], LlamaDecoder], kernel_name: str, ids: torch.Tensor) -> LlamaDecoder:
    """The decoder in int8 on the first candidate kernel (fastest first) that keeps at least
    TOKEN_AGREEMENT_FLOOR of float32's greedy next tokens over `ids` (PROBE_TEXT); none: refused
    in one line.

    NOTE: the kernels have passed the layer-level accuracy probe (models/int8_kernels.probe_kernels);
    this checks the whole model, where a layer's error compounds through the depth."""
    model = build_float()
    vocab = model.embed.weight.shape[0]
    ids = ids.clamp(max=vocab - 1) if len(ids) >= 16 else (torch.arange(1, 65) * 7919) % vocab
    reference = next_tokens(model, ids)
    kernels = candidate_kernels(kernel_name)
    if not kernels:
        raise ConfigError(f"--quantize int8: {no_accurate_kernel()}")
    # NOTE: timed on a dense MLP's gate/up, or where every layer routes to experts, on q/k/v
    timed = next((layer.gate_up for layer in model.layers if layer.moe is None), model.layers[0].qkv)
    first = pick_kernel(timed.weight.detach(), INT8_ROWS, kernels) if len(kernels) > 1 else kernels[0]
    found: list[str] = []
    for i, kernel in enumerate([first] + [k for k in kernels if k != first]):
        if i:
            model = build_float()
        quantize_decoder_int8(model, INT8_ROWS, kernel)
        agreement = float((next_tokens(model, ids) == reference).float().mean())
        if agreement >= TOKEN_AGREEMENT_FLOOR:
            return model
        found.append(f"{kernel.name} {agreement:.0%}")
    missing = missing_int8_instructions()
    raise ConfigError(
        f"--quantize int8 refused: int8 keeps under {TOKEN_AGREEMENT_FLOOR:.0%} of float32's next tokens on a "
        f"reference text ({', '.join(found)}){'; ' + missing if missing else ''}"
    )


__all__ = ["INT8_ROWS", "PROBE_TEXT", "TOKEN_AGREEMENT_FLOOR", "int8_checked", "next_tokens"]
