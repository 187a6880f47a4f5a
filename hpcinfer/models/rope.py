"""Rotary position embeddings: inverse frequencies and the cos/sin scale for each `rope_type`.

A checkpoint's `rope_parameters` (or legacy `rope_scaling`) picks the type; every type here gives
the tables transformers computes for the same config, in float32 and in the same order, so greedy
ties break the same way. The engine runs positions 0..max_position_embeddings-1 only, and within
that range the types whose frequencies depend on the current length reduce to fixed tables:

- `dynamic` (NTK) rescales only once a sequence outgrows `max_position_embeddings`: never here,
  so its frequencies are the default ones.
- `yarn` blends interpolated and extrapolated frequencies and scales cos/sin by an attention
  factor; it does not depend on the length.
- `longrope` (Phi-3, Phi-4; `su` in older configs) divides each frequency by its short factor and
  scales cos/sin by sqrt(1 + ln(factor) / ln(original context)); transformers switches to the long
  factors (for every position) once a sequence passes the original context, so the engine's context
  stops there (DecoderConfig.max_model_len).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su")


def _default(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, p: Mapping[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): per-dimension ramp between interpolation and extrapolation."""
    old_ctx = float(p["original_max_position_embeddings"])
    factor = float(p["factor"]) if p.get("factor") is not None else max_positions / old_ctx
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        """The dimension whose wavelength makes `rotations` turns over the original context."""
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the dimension keeps its trained frequency (extrapolation)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _longrope(theta: float, dim: int, p: Mapping[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    old_ctx = float(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or max_positions / old_ctx)
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    short = torch.tensor(p["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (short * theta**shape), float(attention)


def rope_frequencies(
    theta: float, dim: int, scaling: Mapping[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], scale applied to cos and sin) for a RoPE config."""
    kind = scaling.get("rope_type", "default")
    if kind == "yarn":
        return _yarn(theta, dim, scaling, max_positions)
    if kind in ("longrope", "su"):
        return _longrope(theta, dim, scaling, max_positions)
    inv = _default(theta, dim)
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope_type {kind!r}")
    return inv, 1.0


def rope_tables(
    theta: float, dim: int, scaling: Mapping[str, Any], max_positions: int, positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [positions, dim/2] for positions 0..positions-1 (`max_positions`: the config's)."""
    inv, scale = rope_frequencies(theta, dim, scaling, max_positions)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin
