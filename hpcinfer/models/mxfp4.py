"""MXFP4 (OCP microscaling, 4-bit E2M1 values with one E8M0 scale per 32) dequantized at load.

gpt-oss ships its experts this way: for a weight of [experts, rows, columns], `*_blocks`
[experts, rows, columns / 32, 16] bytes hold two 4-bit values each (the low nibble first) and
`*_scales` [experts, rows, columns / 32] one power-of-two exponent per 32 values (biased by 127).
The engine runs float experts, so they are expanded once, at load: 4.25 bits a weight become the
run's dtype (7.5x the bytes in float32, 3.8x in bfloat16).
"""

from __future__ import annotations

import torch

# the 16 values of an E2M1 nibble: sign, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., rows, groups, 16] uint8 and scales [..., rows, groups] -> [..., rows, groups * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = torch.tensor(E2M1, dtype=dtype)
    packed = blocks.to(torch.uint8)
    values = torch.stack([table[(packed & 0x0F).long()], table[(packed >> 4).long()]], dim=-1)  # low nibble first
    values = values.flatten(-2)  # [..., rows, groups, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


__all__ = ["E2M1", "dequantize_mxfp4"]
