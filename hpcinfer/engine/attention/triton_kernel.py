"""A Triton paged-attention kernel: each query token reads its sequence's K/V blocks in place.

One program per (query token, KV head) walks the token's block table a block at a time with an
online softmax, for all the query heads that share the KV head (GQA). Nothing is gathered or
repeated per head: the gather path copies a sequence's whole context every layer and step, and
SDPA with a mask and GQA on CUDA runs its math kernel, which repeats K/V to every head in float32.

A token is given by the row of its block table and its context length (its position + 1), so one
launch serves decodes (one token a sequence) and continued prefill chunks (causal by context
length) alike. A sliding-window layer's token starts at the first block its window reaches (the
blocks before it are never read) and masks the keys before the window; Gemma 2's soft cap
(cap * tanh(score / cap)) applies to the scaled scores; gpt-oss's sinks start each head's softmax
with its sink logit, which takes a share of the probability and brings no value. On CUDA the
kernel is compiled (`triton.jit`); on the CPU the same function runs in Triton's interpreter,
which is how the tests check it against the reference path.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # NOTE: without CUDA the kernel can only run in Triton's interpreter, and Triton reads this
    # when it is first imported: its own library functions (tl.sum, tl.zeros) are built then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402


def _paged_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    rows_ptr,
    context_ptr,
    sinks_ptr,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_table,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + token).to(tl.int64)
    context = tl.load(context_ptr + token)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_P)
    s = tl.arange(0, BLOCK)
    heads = kv_head * GROUP + g
    qd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    q = q.to(tl.float32) * scale
    if HAS_SINKS:  # the sink is a key of score `sink` and no value: the softmax starts from it
        best = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0).to(tl.float32)
        total = tl.full([GROUP_P], 1.0, tl.float32)
    else:
        best = tl.full([GROUP_P], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_P], tl.float32)
    # the first key the token sees: the start of its window on a sliding-window layer (window > 0)
    first = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    for j in range(first // BLOCK, tl.cdiv(context, BLOCK)):
        block = tl.load(tables_ptr + row * stride_table + j).to(tl.int64)
        key = j * BLOCK + s
        inside = (key < context) & (key >= first)
        where = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kd_mask = inside[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + where, mask=kd_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + where, mask=kd_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_P, BLOCK]
        if softcap > 0:  # NOTE: tanh(x) = 1 - 2 / (exp(2x) + 1): exp alone, in the interpreter too
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(inside[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        fade = tl.exp(best - new_best)
        p = tl.exp(scores - new_best[:, None])
        total = total * fade + tl.sum(p, axis=1)
        acc = acc * fade[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    out = acc / total[:, None]
    where_out = out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(where_out, out.to(out_ptr.dtype.element_ty), mask=qd_mask)


# NOTE: a step's table is as wide as its widest sequence, so its row stride changes from step to
# step; Triton would specialise an integer argument on being 1 or a multiple of 16 and compile the
# kernel again for each new case, inside a timed run. The other strides are the model's and fixed;
# a layer's window (0 or its size) would make a second kernel for a model's other layers.
NOT_SPECIALIZED = ("stride_table", "window")  # a window: one compiled kernel for global and local layers
_kernel = triton.jit(_paged_attention, do_not_specialize=NOT_SPECIALIZED)  # interpreted under TRITON_INTERPRET


def paged_attention(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    context: torch.Tensor,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; pools [blocks, block_size, Hkv, D]; tables [R, width] block ids; rows [T] the
    table of each token; context [T] the keys each token sees (its position + 1) -> [T, H, D].
    `window`: a sliding-window layer's (a key is seen when position - key < window; 0: every key);
    `softcap`: Gemma 2's cap on the scores; `sinks` [H]: gpt-oss's per-head sink logits."""
    t, heads, dim = q.shape
    _blocks, block_size, kv_heads, _ = pool_k.shape
    assert pool_k.stride() == pool_v.stride() and pool_k.stride(-1) == 1 and q.stride(-1) == 1
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if q.device.type != "cuda" and not isinstance(_kernel, InterpretedFunction):
        raise RuntimeError("the Triton kernel runs on the CPU only in Triton's interpreter: set TRITON_INTERPRET=1")
    _kernel[(t, kv_heads)](
        q,
        pool_k,
        pool_v,
        out,
        tables,
        rows,
        context,
        q if sinks is None else sinks,  # NOTE: never read without sinks (HAS_SINKS is a constant)
        dim**-0.5,
        window,
        float(softcap or 0.0),
        q.stride(0),
        q.stride(1),
        pool_k.stride(0),
        pool_k.stride(1),
        pool_k.stride(2),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        BLOCK=block_size,
        HEAD_DIM=dim,
        HEAD_P=triton.next_power_of_2(dim),
        HAS_SINKS=sinks is not None,
    )
    return out
