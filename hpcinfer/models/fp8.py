"""FP8 (e4m3) weights for the decoder's linear layers: `--quantize fp8`.

Each weight is stored as float8_e4m3fn with one float32 scale per output channel (its row's
largest magnitude maps to e4m3's largest, 448), half the bytes of bfloat16. A forward quantizes
the activations per token the same way and multiplies in FP8 with `torch._scaled_mm`'s row-wise
scales (tensor cores on CUDA compute capability 8.9+; the same call runs on the CPU, so the tests
run the path the GPU runs), accumulating in float and writing bfloat16. Where `_scaled_mm` cannot
run (a shape not a multiple of 16, an older GPU) the weight is dequantized for an ordinary matmul:
FP8 then saves memory, not time. Embeddings, norms and the LM head stay in the run's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..device import accelerators

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
QUANTIZED = ("qkv", "o_proj", "gate_up", "down")  # a decoder layer's linear layers


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (float8 [rows, cols], float32 scales [rows, 1]) with x ≈ q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_mm_problem(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on `device` (weights are then dequantized), or None."""
    if device.type == "cuda" and accelerators.capability(device) < (8, 9):
        return "FP8 matmuls need CUDA compute capability 8.9 or newer"
    return None


class Fp8Linear(nn.Module):
    """A linear layer over an FP8 weight with per-output-channel scales."""

    def __init__(self, linear: nn.Linear, use_scaled_mm: bool = True) -> None:
        super().__init__()
        qweight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("qweight", qweight)  # [out, in]
        self.register_buffer("scale", scale.view(1, -1))  # [1, out], as _scaled_mm's scale_b
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.dtype = linear.weight.dtype
        out_features, in_features = qweight.shape
        self.use_scaled_mm = use_scaled_mm and in_features % 16 == 0 and out_features % 16 == 0

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] in the run's dtype (for code that reads `.weight`)."""
        return (self.qweight.float() * self.scale.view(-1, 1)).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_scaled_mm:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        qx, x_scale = quantize_rows(rows)
        out = torch._scaled_mm(qx, self.qweight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16).to(
            x.dtype
        )
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], -1)


def quantize_decoder_fp8(model: nn.Module, device: torch.device) -> nn.Module:
    """Replaces every decoder layer's linear layers with Fp8Linear, in place; returns the model."""
    use_scaled_mm = scaled_mm_problem(device) is None
    for layer in model.layers:
        for name in QUANTIZED:
            setattr(layer, name, Fp8Linear(getattr(layer, name), use_scaled_mm))
    return model


__all__ = ["FP8", "FP8_MAX", "Fp8Linear", "quantize_decoder_fp8", "quantize_rows", "scaled_mm_problem"]
