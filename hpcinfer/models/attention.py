"""Attention over one whole sequence, and the eager forms the paged attention also runs where SDPA
lacks an option (Gemma 2's soft-capped scores, gpt-oss's per-head sinks)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .decoder_config import DecoderConfig


def in_window(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """[len(queries), len(keys)] True where a key is causal to the query and within its window
    (query - key < window, as transformers' sliding-window masks)."""
    gap = queries[:, None] - keys[None, :]
    return (gap >= 0) & (gap < window)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention as transformers' eager path computes it, for what SDPA has no option for: Gemma 2's
    soft cap (cap * tanh(scores / cap), before the mask) and gpt-oss's sinks (each head's learned
    logit joins the softmax and is dropped after it, so a query may attend to nothing).
    q [B, H, Lq, D], k/v [B, Hkv, Lk, D], `mask` boolean (True: attend) or additive, `causal`
    aligned to the last query, `sinks` [H]."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        lq, lk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch's SDPA (grouped-query), or the soft-capped form where a model caps its scores, or with
    gpt-oss's per-head sinks."""
    if sinks is not None or softcap:
        return eager_attention(q, k, v, mask, causal, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    k_start: int,
    window: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A sliding-window layer's causal attention over a long run of queries, in blocks of `window`
    queries each against the keys its window reaches (at most 2 x window - 1), so the scores cost
    queries x window, not queries x keys. q [1, H, n, D] at positions q_start..q_start + n - 1;
    k/v [1, Hkv, m, D] at positions k_start.. up to the last query's; a key is seen when
    position - key < window (`in_window`). Masks are additive: SDPA's CPU kernel runs them faster."""
    end = q_start + q.shape[-2]
    outs = []
    for a in range(q_start, end, window):
        b = min(a + window, end)
        lo = max(k_start, a - window + 1)
        seen = in_window(torch.arange(a, b, device=q.device), torch.arange(lo, b, device=q.device), window)
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, -torch.inf)
        keys = slice(lo - k_start, b - k_start)
        rows = q[..., a - q_start : b - q_start, :]
        outs.append(scaled_dot_product_attention(rows, k[..., keys, :], v[..., keys, :], mask, False, softcap, sinks))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


class Attention(Protocol):
    """What a layer needs from the batch: attend q [T, H, D] to this step's k, v [T, Hkv, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Returns [T, H * D]."""
        ...


class DenseCausalAttention:
    """One whole sequence, no cache: the reference path (and the model's own unit test).
    `windows`: each layer's sliding window (DecoderConfig.layer_windows), if any."""

    def __init__(self, windows: tuple[int, ...] = (), softcap: float | None = None) -> None:
        self.windows, self.softcap = windows, softcap

    @classmethod
    def of(cls, cfg: DecoderConfig) -> DenseCausalAttention:
        return cls(cfg.layer_windows, cfg.attn_softcap)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        window = self.windows[layer] if self.windows else 0
        mask = None
        if window and q.shape[0] > window:
            pos = torch.arange(q.shape[0], device=q.device)
            mask = in_window(pos, pos, window)
        out = scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, mask is None, self.softcap, sinks
        )
        return out.transpose(0, 1).reshape(q.shape[0], -1)


__all__ = ["Attention", "DenseCausalAttention", "eager_attention", "in_window", "scaled_dot_product_attention"]
