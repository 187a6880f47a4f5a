"""What a decoder checkpoint's config.json says, read into the one `DecoderConfig` every native
decoder family runs from (models/llama.py): the family's registry line, its RoPE, sliding windows,
norms, soft caps, sinks and experts, each read from transformers 5's names and the older ones.
An architecture, activation or RoPE type the native decoder lacks is an `UnsupportedModel`, which
`--backend auto` turns into the transformers fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F

from ..errors import UnsupportedModel
from .rope import ROPE_TYPES

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
        theta, rope = _rope(raw, 10000.0)
        rope_type = rope["rope_type"]
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


def _rope(raw: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any]]:
    """(base, RoPE parameters with their `rope_type`): transformers >= 5 writes `rope_parameters`
    (rope_theta inside); older checkpoints write `rope_theta` beside a `rope_scaling` dict (or null)."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", default_theta)))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if rope["rope_type"] not in ROPE_TYPES:
        supported = ", ".join(ROPE_TYPES)
        raise UnsupportedModel(f"unsupported rope_scaling type {rope['rope_type']!r} (supported: {supported})")
    return theta, rope


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
    theta, rope = _rope(raw, 150_000.0)
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


__all__ = ["ACTIVATIONS", "ARCHITECTURES", "DecoderConfig"]
