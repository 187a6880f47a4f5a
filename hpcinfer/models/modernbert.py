"""ModernBERT (gte-modernbert, modernbert-embed, ...): a pre-norm encoder with RoPE, GeGLU, no
biases, and layers that alternate global attention with a local sliding window.

Every third layer (the config's `layer_types`) attends to the whole row with RoPE base 160,000;
the others to the keys within `local_attention / 2` tokens on either side, with base 10,000. The
embedding is the token's alone (positions are RoPE's), layer 0 has no attention norm, and a final
norm closes the stack.

NOTE: the point of ModernBERT is unpadded ("varlen") attention; here a batch whose padding is a
large share of it runs its linears on the real tokens only (`Rows`): the rows are packed, the
attention alone sees them padded again, so the matmuls do no work for the padding. Packing costs a
gather and a scatter per layer, more than it saves on the length-sorted batches the pipeline
usually makes (3-4% padding), so a batch is packed only when under `UNPAD_BELOW` of its tokens
are real (rows in arrival order: a small --sort-window, --rate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..device.cuda import capturing
from ..errors import UnsupportedModel
from .bert import pack_layers
from .weight_names import renamed


@dataclass(frozen=True, slots=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    sliding: tuple[bool, ...]  # per layer: local (sliding-window) attention, else global
    global_theta: float = 160_000.0
    local_theta: float = 10_000.0
    window: int = 64  # a local layer's query sees keys at most this many tokens away
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_activation: str = "gelu"
    pad_token_id: int = 0
    position_offset: int = 0  # read by the tokenizer's length limit, as for every encoder
    type_vocab_size: int = 0
    model_type: str = "modernbert"


def modernbert_config(raw: dict[str, Any]) -> ModernBertConfig:
    """From a config.json as transformers 5 writes it (`layer_types`, `rope_parameters` per layer
    type) or as the hub's older checkpoints do (`global_attn_every_n_layers`, `global_rope_theta`,
    `local_rope_theta`)."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "full_attention" if i % int(raw.get("global_attn_every_n_layers", 3)) == 0 else "sliding_attention"
        for i in range(layers)
    ]
    if len(types) != layers:
        raise KeyError(f"layer_types names {len(types)} layers of {layers}")
    if raw.get("rope_scaling"):
        raise UnsupportedModel(f"ModernBERT with rope_scaling {raw['rope_scaling']!r} (native: none)")
    rope = raw.get("rope_parameters") or {}
    full, local = (rope.get(k, rope) or {} for k in ("full_attention", "sliding_attention"))
    for part in (full, local):
        if part.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"ModernBERT with rope_type {part['rope_type']!r} (native: default)")
    activation = str(raw.get("hidden_activation", "gelu"))
    if activation not in _ACTIVATIONS:
        raise UnsupportedModel(f"ModernBERT with hidden_activation {activation!r} (native: {', '.join(_ACTIVATIONS)})")
    return ModernBertConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=int(raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        sliding=tuple(t == "sliding_attention" for t in types),
        global_theta=float(full.get("rope_theta", raw.get("global_rope_theta", 160_000.0))),
        local_theta=float(local.get("rope_theta", raw.get("local_rope_theta", 10_000.0))),
        window=int(raw.get("local_attention", 128)) // 2,
        norm_eps=float(raw.get("norm_eps", 1e-5)),
        norm_bias=bool(raw.get("norm_bias", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_activation=activation,
        pad_token_id=int(raw.get("pad_token_id") or 0),
    )


_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def rotary_tables(
    theta: float, dim: int, n: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, dim/2] of default RoPE (rope.py's frequencies), made on `device`: nothing is
    copied from the host, so a CUDA graph can capture the forward."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim))
    freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout (transformers' rotate_half): x [..., n, d], cos/sin [n, d/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, index: int) -> None:
        super().__init__()
        h, eps, bias = cfg.hidden_size, cfg.norm_eps, cfg.norm_bias
        self.heads = cfg.num_attention_heads
        self.sliding = cfg.sliding[index]
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else nn.LayerNorm(h, eps=eps, bias=bias)
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.attn_out = nn.Linear(h, h, bias=cfg.attention_bias)
        self.mlp_norm = nn.LayerNorm(h, eps=eps, bias=bias)
        self.ffn_in = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.act = _ACTIVATIONS[cfg.hidden_activation]

    def forward(self, x: torch.Tensor, rows: Rows, rope: tuple[torch.Tensor, torch.Tensor], mask: Any) -> torch.Tensor:
        """x: the batch's tokens, [tokens, h] packed (or [b, n, h] padded)."""
        h = x.shape[-1]
        qkv = rows.padded(self.qkv(self.attn_norm(x)))  # [b, n, 3h]
        b, n, _ = qkv.shape
        q, k, v = qkv.view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = rope
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, attn_mask=mask)
        x = x + self.attn_out(rows.packed(a.transpose(1, 2).reshape(b, n, h)))
        up, gate = self.ffn_in(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.ffn_out(self.act(up) * gate)


UNPAD_BELOW = 0.85  # pack a batch's rows when fewer than this share of its tokens are real


class Rows:
    """The batch's real tokens: `packed` takes them out of a padded [b, n, ...] tensor, `padded`
    puts them back; a batch left padded (`unpad_below`: packed only under that share of real
    tokens) hands the tensor through."""

    def __init__(self, token_mask: torch.Tensor, unpad_below: float) -> None:
        self.shape = token_mask.shape
        self.index = None
        if unpad_below > 0:
            index = token_mask.reshape(-1).nonzero().squeeze(1)
            if index.numel() < unpad_below * token_mask.numel():
                self.index = index

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.index is None else x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return x
        out = x.new_zeros(self.shape[0] * self.shape[1], x.shape[-1])
        return out.index_copy_(0, self.index, x).view(*self.shape, x.shape[-1])


class ModernBertEncoder(nn.Module):
    """Consumes ids [rows, padded_len] and lengths [rows]; produces hidden states [rows, len, hidden]."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.unpad_below = UNPAD_BELOW  # NOTE: 0 (never) or above 1 (always) to measure packing (benchmarks)

    def forward(
        self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool = True, token_types: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden [b, n, h], token mask [b, n] bool); ModernBERT has no token types."""
        n = ids.shape[1]
        positions = torch.arange(n, device=ids.device)
        token_mask = positions[None, :] < lengths[:, None]
        # NOTE: packing reads the row count back from the device: never while a CUDA graph is captured
        rows = Rows(token_mask, self.unpad_below if padded and not capturing(ids) else 0.0)
        x = rows.packed(self.embed_norm(self.word_embeddings(ids)))
        head_dim = self.cfg.hidden_size // self.cfg.num_attention_heads
        ropes = {
            sliding: rotary_tables(theta, head_dim, n, ids.device, x.dtype)
            for sliding, theta in ((False, self.cfg.global_theta), (True, self.cfg.local_theta))
        }
        keys = token_mask[:, None, None, :] if padded else None
        local = keys  # NOTE: a row no longer than the window: its local layers see all of it
        if n > self.cfg.window + 1:
            near = (positions[None, :] - positions[:, None]).abs() <= self.cfg.window  # [n, n]
            local = near if keys is None else near & keys
        for layer in self.layers:
            x = layer(x, rows, ropes[layer.sliding], local if layer.sliding else keys)
        return rows.padded(self.final_norm(x)), token_mask

    def pack_for_cpu(self) -> ModernBertEncoder:
        """Every layer's linears on prepacked oneDNN weights."""
        pack_layers(self.layers)
        return self


_RENAMES = [
    (r"^embeddings\.tok_embeddings\.", "word_embeddings."),
    (r"^embeddings\.norm\.", "embed_norm."),
    (r"^layers\.(\d+)\.attn\.Wqkv\.", r"layers.\1.qkv."),
    (r"^layers\.(\d+)\.attn\.Wo\.", r"layers.\1.attn_out."),
    (r"^layers\.(\d+)\.mlp\.Wi\.", r"layers.\1.ffn_in."),
    (r"^layers\.(\d+)\.mlp\.Wo\.", r"layers.\1.ffn_out."),
    (r"^(layers\.\d+\.(attn_norm|mlp_norm)\.|final_norm\.)", r"\1"),
]


def rename_modernbert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ModernBERT checkpoint's tensors under `ModernBertEncoder`'s names (the heads' dropped)."""
    named = ((renamed(re.sub(r"^model\.", "", name), _RENAMES), tensor) for name, tensor in weights.items())
    return {name: tensor for name, tensor in named if name is not None}


__all__ = ["ModernBertConfig", "ModernBertEncoder", "modernbert_config", "rename_modernbert", "rotary_tables", "rotate"]
