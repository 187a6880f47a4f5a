"""NomicBERT (nomic-embed-text v1 / v1.5): BERT's post-norm layers with rotary positions, SwiGLU
and no biases in the attention or the MLP.

The embedding is the word's plus token type 0's, normalised (no position table: RoPE, base 1,000
by default). Weights load under the names transformers 5 gives them (`self_attn.q_proj`,
`mlp.gate_proj`, ...) or the hub checkpoints' own (`attn.Wqkv`, `mlp.fc11`, `norm1`, ...), and the
config under either's field names (`hidden_size` or `n_embd`, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModel
from .bert import pack_layers
from .modernbert import rotary_tables, rotate
from .weight_names import renamed


@dataclass(frozen=True, slots=True)
class NomicBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    rope_theta: float = 1000.0
    pad_token_id: int = 0
    position_offset: int = 0
    model_type: str = "nomic_bert"


def _field(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    if default is None:
        raise KeyError(names[0])
    return default


def nomic_bert_config(raw: dict[str, Any]) -> NomicBertConfig:
    activation = str(_field(raw, "hidden_act", "activation_function", default="silu"))
    if activation not in ("silu", "swiglu"):
        raise UnsupportedModel(f"NomicBERT with activation {activation!r} (native: SwiGLU)")
    original = {  # NOTE: the hub's own config names what the native layers do not have
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "causal": False,
        "rotary_scaling_factor": None,  # NOTE: dynamic NTK scaling past the trained length: not here
        "rotary_emb_scale_base": None,
    }
    for name, native in original.items():
        if raw.get(name, native) != native:
            raise UnsupportedModel(f"NomicBERT with {name} {raw[name]!r} (native: {native!r})")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"NomicBERT with rope_type {rope['rope_type']!r} (native: default)")
    hidden = int(_field(raw, "hidden_size", "n_embd"))
    return NomicBertConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=int(_field(raw, "num_hidden_layers", "n_layer")),
        num_attention_heads=int(_field(raw, "num_attention_heads", "n_head")),
        intermediate_size=int(_field(raw, "intermediate_size", "n_inner", default=4 * hidden)),
        max_position_embeddings=int(_field(raw, "max_position_embeddings", "n_positions", default=2048)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        layer_norm_eps=float(_field(raw, "layer_norm_eps", "layer_norm_epsilon", default=1e-12)),
        rope_theta=float(_field(raw, "rope_theta", "rotary_emb_base", default=rope.get("rope_theta", 1000.0))),
        pad_token_id=int(raw.get("pad_token_id") or 0),
    )


class NomicBertLayer(nn.Module):
    def __init__(self, cfg: NomicBertConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.heads = cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.attn_out = nn.Linear(h, h, bias=False)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.ffn_in = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)  # gate, then up
        self.ffn_out = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.ffn_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: Any) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = rope
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, attn_mask=mask)
        x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, n, h)))
        gate, up = self.ffn_in(x).chunk(2, dim=-1)
        return self.ffn_norm(x + self.ffn_out(F.silu(gate) * up))


class NomicBertEncoder(nn.Module):
    """Consumes ids [rows, padded_len] and lengths [rows]; produces hidden states [rows, len, hidden]."""

    def __init__(self, cfg: NomicBertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(NomicBertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(
        self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool = True, token_types: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden [b, n, h], token mask [b, n] bool); `token_types` [b, n] for text pairs."""
        n = ids.shape[1]
        token_mask = torch.arange(n, device=ids.device)[None, :] < lengths[:, None]
        table = self.token_type_embeddings
        types = table(token_types) if token_types is not None else table.weight[0]  # single segment: type 0
        x = self.embed_norm(self.word_embeddings(ids) + types)
        head_dim = self.cfg.hidden_size // self.cfg.num_attention_heads
        rope = rotary_tables(self.cfg.rope_theta, head_dim, n, ids.device, x.dtype)
        mask = token_mask[:, None, None, :] if padded else None
        for layer in self.layers:
            x = layer(x, rope, mask)
        return x, token_mask

    def pack_for_cpu(self) -> NomicBertEncoder:
        """Every layer's linears on prepacked oneDNN weights."""
        pack_layers(self.layers)
        return self


_PARTS = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj|attn\.Wqkv)\.weight$")
_RENAMES = [
    (r"^embeddings\.word_embeddings\.", "word_embeddings."),
    (r"^embeddings\.token_type_embeddings\.", "token_type_embeddings."),
    (r"^(embeddings\.LayerNorm|emb_ln)\.", "embed_norm."),
    (r"^layers\.(\d+)\.(self_attn\.o_proj|attn\.out_proj)\.", r"layers.\1.attn_out."),
    (r"^layers\.(\d+)\.(post_attention_layernorm|norm1)\.", r"layers.\1.attn_norm."),
    (r"^layers\.(\d+)\.(mlp\.down_proj|mlp\.fc2)\.", r"layers.\1.ffn_out."),
    (r"^layers\.(\d+)\.(post_mlp_layernorm|norm2)\.", r"layers.\1.ffn_norm."),
]
_FC = {"mlp.fc12": "mlp.gate_proj", "mlp.fc11": "mlp.up_proj"}  # the hub's names for the gate and up


def rename_nomic_bert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A NomicBERT checkpoint's tensors (transformers' names or the hub's) under `NomicBertEncoder`'s,
    Q, K and V fused and the gate and up projections fused."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        name = re.sub(r"^(nomic_bert|bert|model)\.", "", name).replace("encoder.layers.", "layers.")
        for old, new in _FC.items():
            name = name.replace(old, new)
        if m := _PARTS.match(name):
            parts.setdefault(m[1], {})[m[2].rsplit(".", 1)[-1]] = tensor
        elif (new := renamed(name, _RENAMES)) is not None:
            state[new] = tensor
    for layer, got in parts.items():
        if "Wqkv" in got:
            state[f"layers.{layer}.qkv.weight"] = got["Wqkv"]
        elif {"q_proj", "k_proj", "v_proj"} <= set(got):
            state[f"layers.{layer}.qkv.weight"] = torch.cat([got["q_proj"], got["k_proj"], got["v_proj"]])
        if {"gate_proj", "up_proj"} <= set(got):
            state[f"layers.{layer}.ffn_in.weight"] = torch.cat([got["gate_proj"], got["up_proj"]])
    return state


__all__ = ["NomicBertConfig", "NomicBertEncoder", "nomic_bert_config", "rename_nomic_bert"]
