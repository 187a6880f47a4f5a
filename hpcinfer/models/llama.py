"""A native Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, Gemma 2, Gemma 3, and the
mixtures of experts Qwen3-MoE and Mixtral) over flat, variable-length batches.

Consumes flat token ids [T] with their positions [T] and an attention object that owns the KV
cache and the batch's layout; produces hidden states [T, hidden]. The model knows nothing about
pages or sequences: attention metadata is an argument, never a module global, so several threads
(or a reference path and a paged path) can run the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..device.cpu_shape import matmul_slice_rows
from ..errors import UnsupportedModel
from .moe import GptOssMoE, MoE
from .rope import ROPE_TYPES, rope_tables

# NOTE: on CPU, MKL runs a [T, hidden] x [hidden, 2 * intermediate] matmul well below its usual
# FLOP/s when T is a decode batch (measured on one core, hidden 512, intermediate 1536, T = 128:
# 43 GFLOP/s as one matmul, 66 in slices of 512 columns), so the MLP's gate and up run in slices
# sized to this CPU's L2 (`matmul_slice_rows`: 512 columns on that 2 MiB L2).

# HF architecture name -> family. Families differ in biases (qwen2's q/k/v, llama's optional ones),
# q/k RMSNorm (qwen3), and phi3's partial rotary dimensions and LongRoPE; phi3 checkpoints store q/k/v
# and gate/up already fused, as this model runs them (decoder_checkpoint.py).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    context_cap: int | None = None  # --max-model-len: a context shorter than the checkpoint's
    rotary_dim: int = 0  # dimensions of each head RoPE turns (phi3's partial_rotary_factor); 0: all
    # Gemma 2 and 3: each layer's sliding window (keys with query - key < window; 0: every key), the
    # local layers' own RoPE base (Gemma 3), post-attention and post-MLP norms, embeddings scaled by
    # sqrt(hidden), GELU (tanh), a query scale of its own (query_pre_attn_scalar ** -0.5), and
    # Gemma 2's tanh soft-capping of attention scores and of the final logits
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    hidden_act: str = "silu"
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Mixtures of experts (models/moe.py): which layers route (the others keep a dense MLP of
    # `intermediate_size`), how many experts, how many each token takes, their MLP width, and
    # whether the chosen experts' weights are renormalised to sum to one
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    renormalize_experts: bool = False
    # gpt-oss: each head's learned attention sink, and its experts' clamped SwiGLU (models/moe.py)
    attn_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DecoderConfig:
        """Reads a HF config.json; raises ModelError for an architecture or RoPE type we don't run."""
        arch = next(iter(raw.get("architectures") or []), None)
        family = ARCHITECTURES.get(str(arch))
        if family is None:
            raise UnsupportedModel(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        if family in ("gemma2", "gemma3"):
            return _gemma(raw, family)
        if family == "gpt_oss":
            return _gpt_oss(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"unsupported hidden_act {raw.get('hidden_act')!r} (supported: silu)")
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older checkpoints
        # write `rope_theta` beside a `rope_scaling` dict (or null).
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModel(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        rope["rope_type"] = rope_type
        partial = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0 and family != "phi3":
            raise UnsupportedModel(f"partial_rotary_factor {partial} on {arch} (native: phi3 only)")
        if rope_type == "longrope":
            # NOTE: the short factors up to the pretraining context; past it transformers recomputes
            # every position with the long ones, which a KV cache cannot follow: the context stops there
            rope.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
            if rope["original_max_position_embeddings"] is None or rope.get("short_factor") is None:
                raise UnsupportedModel("longrope without original_max_position_embeddings or short_factor")
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3", "qwen3_moe"):
            window = window if raw.get("use_sliding_window") else None
        experts = _experts(raw, family)
        return cls(
            architecture=str(arch),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or (family == "llama" and bool(raw.get("attention_bias"))),
            o_bias=family == "llama" and bool(raw.get("attention_bias")),
            mlp_bias=family == "llama" and bool(raw.get("mlp_bias")),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=int(window) if window else None,
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            **experts,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence we run exactly: positions, capped by a sliding window we don't implement
        and by --max-model-len."""
        caps = [c for c in (self.sliding_window, self.context_cap) if c]
        if self.rope_scaling.get("rope_type") == "longrope":
            caps.append(int(self.rope_scaling["original_max_position_embeddings"]))
        return min([self.max_position_embeddings, *caps])

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head RoPE turns: all, or phi3's leading fraction."""
        return self.rotary_dim or self.head_dim


def _experts(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """The DecoderConfig fields of a mixture of experts (none for a dense family): Mixtral routes in
    every layer and always renormalises; Qwen3-MoE in every `decoder_sparse_step`-th layer but
    `mlp_only_layers`, renormalising where `norm_topk_prob` says."""
    if family == "mixtral":
        count, width, renormalize = int(raw["num_local_experts"]), int(raw["intermediate_size"]), True
        layers = (True,) * int(raw["num_hidden_layers"])
    elif family == "qwen3_moe":
        # NOTE: transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`
        count = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        width = int(raw.get("moe_intermediate_size") or 0)
        renormalize = bool(raw.get("norm_topk_prob"))
        step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or [])
        n = int(raw["num_hidden_layers"])
        layers = tuple(count > 0 and i not in dense and (i + 1) % step == 0 for i in range(n))
    else:
        return {}
    # NOTE: router_jitter_noise is training-time noise: inference routes without it, as transformers does
    top_k = int(raw["num_experts_per_tok"])
    if any(layers) and not 0 < top_k <= count:
        raise UnsupportedModel(f"num_experts_per_tok {top_k} with {count} experts")
    return {
        "moe_layers": layers if any(layers) else (),
        "num_experts": count,
        "experts_per_token": top_k,
        "expert_intermediate_size": width,
        "renormalize_experts": renormalize,
    }


def _gpt_oss(raw: dict[str, Any]) -> DecoderConfig:
    """gpt-oss (GptOssForCausalLM): sliding-window and global layers in turn, YaRN, biased q/k/v/o,
    a learned sink per head, and experts in every layer (a biased router softmaxing its top-k
    logits, biased experts with a clamped SwiGLU)."""
    quantized = (raw.get("quantization_config") or {}).get("quant_method")
    if quantized not in (None, "mxfp4"):  # MXFP4 experts are expanded at load (models/mxfp4.py)
        raise UnsupportedModel(f"gpt-oss quantized with {quantized!r} (native: float or MXFP4 experts)")
    layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModel(f"gpt-oss layer_types {types!r} (native: sliding_attention, full_attention)")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 150_000.0)))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if rope["rope_type"] not in ROPE_TYPES:
        raise UnsupportedModel(
            f"unsupported rope_scaling type {rope['rope_type']!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    window, experts = int(raw.get("sliding_window") or 128), int(raw["num_local_experts"])
    bias = bool(raw.get("attention_bias", True))
    return DecoderConfig(
        architecture="GptOssForCausalLM",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131_072)),
        rope_theta=theta,
        rope_scaling=rope,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        moe_layers=(True,) * layers,
        num_experts=experts,
        experts_per_token=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["intermediate_size"]),
        attn_sinks=True,
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
    )


def _gemma(raw: dict[str, Any], family: str) -> DecoderConfig:
    """Gemma 2 (Gemma2ForCausalLM) or Gemma 3's text decoder (Gemma3ForCausalLM), from transformers
    5's `rope_parameters` (per layer type for Gemma 3) or the older `rope_theta`,
    `rope_local_base_freq` and `rope_scaling`."""
    gemma3 = family == "gemma3"
    name = "Gemma 3" if gemma3 else "Gemma 2"
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{name} with use_bidirectional_attention (native: causal)")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UnsupportedModel(f"unsupported hidden_activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    layers = int(raw["num_hidden_layers"])
    every = int(raw.get("sliding_window_pattern", 6)) if gemma3 else 2  # one global layer in `every`
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
    ]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModel(f"{name} layer_types {types!r} (native: sliding_attention, full_attention)")
    params = dict(raw.get("rope_parameters") or {})
    if gemma3:
        full = dict(params.get("full_attention") or raw.get("rope_scaling") or {})
        local = dict(params.get("sliding_attention") or {})
        local_theta: float | None = float(local.pop("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))
    else:
        full, local, local_theta = dict(params or raw.get("rope_scaling") or {}), {}, None
    theta = float(full.pop("rope_theta", raw.get("rope_theta", 1_000_000.0 if gemma3 else 10_000.0)))
    full["rope_type"] = full.get("rope_type", full.get("type", "default"))
    if full["rope_type"] not in ROPE_TYPES or local.get("rope_type", "default") != "default":
        supported = f"default on local layers; {', '.join(ROPE_TYPES)} on global ones"
        raise UnsupportedModel(f"{name} RoPE {params or full!r} (native: {supported})")
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    window = int(raw.get("sliding_window") or 4096)
    softcaps = [raw.get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")]
    return DecoderConfig(
        architecture=str(next(iter(raw.get("architectures") or []), "")) or f"{family.title()}ForCausalLM",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or 256),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131_072 if gemma3 else 8192)),
        rope_theta=theta,
        rope_scaling=full,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bool(raw.get("attention_bias")),
        o_bias=bool(raw.get("attention_bias")),
        qk_norm=gemma3,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        local_rope_theta=local_theta,
        sandwich_norms=True,
        embed_scale=hidden**0.5,
        hidden_act=act,
        query_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,
        attn_softcap=float(softcaps[0]) if softcaps[0] else None,
        final_softcap=float(softcaps[1]) if softcaps[1] else None,
    )


def attention_scores_softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, cap: float
) -> torch.Tensor:
    """SDPA with Gemma 2's soft-capping, cap * tanh(scores / cap) before the mask, as transformers'
    eager attention computes it (SDPA has no such option): q [B, H, Lq, D], k/v [B, Hkv, Lk, D],
    `mask` boolean (True: attend) or additive, `causal` aligned to the last query."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / cap) * cap
    if causal:
        lq, lk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, sinks: torch.Tensor
) -> torch.Tensor:
    """gpt-oss's attention: each head's learned sink logit joins the softmax and is dropped after it
    (so a query may attend to nothing), as transformers' eager attention computes it: q [B, H, Lq, D],
    k/v [B, Hkv, Lk, D], `sinks` [H]."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        lq, lk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
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
    if sinks is not None:
        return attention_with_sinks(q, k, v, mask, causal, sinks)
    if softcap:
        return attention_scores_softcapped(q, k, v, mask, causal, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


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
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
        out = scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, mask is None, self.softcap, sinks
        )
        return out.transpose(0, 1).reshape(q.shape[0], -1)


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
        self.q_rescale = cfg.query_scale * d**0.5 if cfg.query_scale else None
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (before the final norm)."""
        x = self.embed(input_ids)
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
