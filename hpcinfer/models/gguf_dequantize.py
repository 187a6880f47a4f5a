"""GGUF's commonest block types (Q4_0, Q4_1, Q8_0, and MXFP4 for gpt-oss's experts) dequantized
with torch ops: multithreaded, ~10x `gguf`'s numpy on SmolLM2's Q4_1 file, with exactly its values
(tests/integration/test_gguf.py checks each type). Every other type is left to `gguf.quants.dequantize`."""

from __future__ import annotations

import numpy as np
import torch

from .mxfp4 import E2M1

# type -> (bytes a block of 32 weights takes, where its 4- or 8-bit values start)
_TORCH_TYPES = {"Q4_0": (18, 2), "Q4_1": (20, 4), "Q8_0": (34, 2)}


def torch_dequantize(raw: np.ndarray, kind: str) -> torch.Tensor | None:
    """The commonest block types dequantized with torch ops (multithreaded, ~10x gguf's numpy on
    SmolLM2's Q4_1 file), the same values as `gguf.quants.dequantize` (tests/integration/test_gguf.py checks);
    None for every other type, which `gguf` dequantizes. Blocks of 32: an fp16 scale d (and for
    Q4_1 an fp16 minimum m), then 32 values: Q4_0 d * (q - 8), Q4_1 d * q + m with q the low nibbles
    then the high ones, Q8_0 d * q."""
    if kind == "MXFP4":
        return _mxfp4(raw)
    if kind not in _TORCH_TYPES:
        return None
    size, start = _TORCH_TYPES[kind]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(-1, size)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    values = blocks[:, start:]
    if kind == "Q8_0":
        return (d * values.contiguous().view(torch.int8).float()).reshape(raw.shape[0], -1)
    q = torch.cat([values & 0x0F, values >> 4], dim=1).float()
    if kind == "Q4_0":
        return (d * (q - 8)).reshape(raw.shape[0], -1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(raw.shape[0], -1)


def _mxfp4(raw: np.ndarray) -> torch.Tensor:
    """llama.cpp's MXFP4 blocks (gpt-oss's experts): 32 weights in 17 bytes, an E8M0 exponent e then
    16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31, each an E2M1 value times
    2^(e - 127): `gguf.quants.MXFP4`'s values (tests/unit/test_decoder_families.py checks)."""
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(-1, 17)
    table = torch.tensor(E2M1, dtype=torch.float32)
    nibbles = blocks[:, 1:]
    values = torch.cat([table[(nibbles & 0x0F).long()], table[(nibbles >> 4).long()]], dim=1)
    return torch.ldexp(values, blocks[:, :1].to(torch.int32) - 127).reshape(raw.shape[0], -1)


__all__ = ["torch_dequantize"]
