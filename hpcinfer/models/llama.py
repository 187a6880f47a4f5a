"""A native Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, Gemma 2, Gemma 3, and the
mixtures of experts Qwen3-MoE and Mixtral) over flat, variable-length batches.

Consumes flat token ids [T] with their positions [T] and an attention object that owns the KV
cache and the batch's layout; produces hidden states [T, hidden]. The model knows nothing about
pages or sequences: attention metadata is an argument, never a module global, so several threads
(or a reference path and a paged path) can run the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..device.cpu_shape import matmul_slice_rows
from .attention import Attention
from .decoder_config import ACTIVATIONS, DecoderConfig
from .moe import GptOssMoE, MoE
from .rope import rope_tables

# NOTE: on CPU, MKL runs a [T, hidden] x [hidden, 2 * intermediate] matmul well below its usual
# FLOP/s when T is a decode batch (measured on one core, hidden 512, intermediate 1536, T = 128:
# 43 GFLOP/s as one matmul, 66 in slices of 512 columns), so the MLP's gate and up run in slices
# sized to this CPU's L2 (`matmul_slice_rows`: 512 columns on that 2 MiB L2).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: statistics in float32, the scale applied in the input dtype (as HF does)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        # NOTE: q, k, v (and gate, up) are fused into one matmul each; the loader concatenates them.
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=cfg.o_bias)
        self.moe: MoE | None = None
        if cfg.moe_layers and cfg.moe_layers[index]:
            inter, experts, top_k = cfg.expert_intermediate_size, cfg.num_experts, cfg.experts_per_token
            if cfg.swiglu_limit is not None:  # gpt-oss
                self.moe = GptOssMoE(h, inter, experts, top_k, cfg.swiglu_limit, cfg.swiglu_alpha)
            else:
                self.moe = MoE(h, inter, experts, top_k, cfg.renormalize_experts, ACTIVATIONS[cfg.hidden_act])
        else:
            self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
            self.down = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))  # before the MLP
        self.local = bool(cfg.layer_windows and cfg.layer_windows[index])  # a sliding-window layer
        self.act = ACTIVATIONS[cfg.hidden_act]
        # NOTE: sdpa scales by 1/sqrt(head_dim); a model with its own scale has q rescaled to match
        rescale = cfg.query_scale * d**0.5 if cfg.query_scale else 1.0
        self.q_rescale = rescale if rescale != 1.0 else None  # NOTE: Gemma's own scale is often sdpa's
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attn_sinks else None
        if cfg.sandwich_norms:
            self.attn_out_norm = nn.Parameter(torch.ones(h))
            self.mlp_out_norm = nn.Parameter(torch.ones(h))
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(d))
            self.k_norm = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv(rms_norm(x, self.input_norm, cfg.rms_norm_eps))
        heads = cfg.num_heads
        v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = rms_norm(q.view(t, heads, cfg.head_dim), self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k.view(t, cfg.num_kv_heads, cfg.head_dim), self.k_norm, cfg.rms_norm_eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if self.q_rescale is not None:
                q = q * self.q_rescale
        else:
            # NOTE: q's and k's heads are adjacent columns of qkv, so one rotation covers both: the
            # same arithmetic in half the elementwise calls (3.5x faster at 1024 tokens on CPU).
            qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + cfg.num_kv_heads, cfg.head_dim)
            qk = _rotate(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            if self.q_rescale is not None:
                q = q * self.q_rescale
        out = self.o_proj(attn(self.index, q, k, v) if self.sinks is None else attn(self.index, q, k, v, self.sinks))
        if cfg.sandwich_norms:
            out = rms_norm(out, self.attn_out_norm, cfg.rms_norm_eps)
        x = x + out
        out = self._mlp(rms_norm(x, self.post_norm, cfg.rms_norm_eps))
        if cfg.sandwich_norms:
            out = rms_norm(out, self.mlp_out_norm, cfg.rms_norm_eps)
        return x + out

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if self.moe is not None:
            return self.moe(h)
        if h.device.type == "cpu" and isinstance(self.gate_up, nn.Linear):
            width = matmul_slice_rows(cfg.hidden_size * h.element_size())
            if width < cfg.intermediate_size:
                return self.down(self._sliced_act(h, width))
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

    def _sliced_act(self, h: torch.Tensor, width: int) -> torch.Tensor:
        """silu(gate) * up [T, intermediate], `width` columns of gate and of up per matmul."""
        inter = self.cfg.intermediate_size
        weight, bias = self.gate_up.weight, self.gate_up.bias
        act = h.new_empty(h.shape[0], inter)
        for start in range(0, inter, width):
            end = min(start + width, inter)
            cols, up_cols = slice(start, end), slice(inter + start, inter + end)  # gate rows, then up rows
            gate = F.linear(h, weight[cols], None if bias is None else bias[cols])
            up = F.linear(h, weight[up_cols], None if bias is None else bias[up_cols])
            torch.mul(F.silu(gate, inplace=True) if self.act is F.silu else self.act(gate), up, out=act[:, cols])
        return act


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in HF's half-split layout: x [T, H, D], cos/sin [T, 1, R/2] turn the first R dimensions
    (R = D but for a partial rotary factor); the others pass unchanged."""
    half = cos.shape[-1]
    if 2 * half != x.shape[-1]:
        x1, x2, rest = x.split([half, half, x.shape[-1] - 2 * half], dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaDecoder(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; `forward` -> hidden, `logits` -> vocab."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("local_cos", torch.empty(0), persistent=False)  # Gemma 3's local layers
        self.register_buffer("local_sin", torch.empty(0), persistent=False)

    def build_rope(self) -> None:
        """The cos/sin table for every position, computed once (float32, then the model's dtype)."""
        c = self.cfg
        cos, sin = rope_tables(c.rope_theta, c.rope_dim, c.rope_scaling, c.max_position_embeddings, c.max_model_len)
        dtype, device = self.norm.dtype, self.norm.device
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)
        if c.local_rope_theta is not None:
            cos, sin = rope_tables(c.local_rope_theta, c.rope_dim, {}, c.max_position_embeddings, c.max_model_len)
            self.local_cos = cos.to(device=device, dtype=dtype)
            self.local_sin = sin.to(device=device, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: Attention,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (before the final norm). `embeds`:
        (rows, vectors) that replace those rows' token embeddings (an image's, models/vlm.py)."""
        x = self.embed(input_ids)
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)  # NOTE: rounded to the dtype first, as HF does
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        local = (
            (self.local_cos[positions].unsqueeze(1), self.local_sin[positions].unsqueeze(1))
            if self.local_cos.numel()
            else None
        )
        for layer in self.layers:
            x = layer(x, *local, attn) if local is not None and layer.local else layer(x, cos, sin, attn)
        return x

    def logits(self, hidden: torch.Tensor, vocab_chunk: int = 0) -> torch.Tensor:
        """hidden [S, hidden] -> float32 logits [S, vocab]; `vocab_chunk` > 0: that many vocabulary rows per matmul.

        NOTE: each logit is the same dot product either way (bit for bit); chunks only change which
        part of the weight a matmul streams through the cache at once.
        """
        logits = self._logits(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps), vocab_chunk)
        if (cap := self.cfg.final_softcap) is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits

    def _logits(self, h: torch.Tensor, vocab_chunk: int) -> torch.Tensor:
        if self.lm_head is not None and not isinstance(self.lm_head, nn.Linear):  # an int8 head (models/int8.py)
            return self.lm_head(h).float()
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        vocab = weight.shape[0]
        if vocab_chunk <= 0 or vocab_chunk >= vocab:
            return F.linear(h, weight).float()
        out = h.new_empty(h.shape[0], vocab, dtype=torch.float32)
        for start in range(0, vocab, vocab_chunk):
            out[:, start : start + vocab_chunk] = F.linear(h, weight[start : start + vocab_chunk])
        return out
