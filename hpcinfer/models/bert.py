"""A native pure-PyTorch BERT-family encoder (BERT, MiniLM, BGE, E5, ...).

Attention goes through `scaled_dot_product_attention`; Q, K and V are one fused projection.
The attention mask and position ids are built on the device from per-row lengths, so only token
ids and lengths ever cross the bus.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    position_offset: int = 0  # RoBERTa / XLM-R / MPNet count positions from padding_idx + 1
    relative_attention_num_buckets: int = 0  # MPNet: a learned bias per head and relative-distance bucket
    model_type: str = "bert"  # the architecture (models/encoders.py) that reads and builds it

    @classmethod
    def from_hf(cls, raw: dict) -> BertConfig:
        fields = cls.__dataclass_fields__
        return cls(**{k: raw[k] for k in fields if k in raw})


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, h = x.shape
        # qkv: [b, n, 3, heads, head_dim] -> 3 x [b, heads, n, head_dim]
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, n, h)))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class BertEncoder(nn.Module):
    """Consumes ids [rows, padded_len] and lengths [rows]; produces hidden states [rows, len, hidden]."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        # NOTE: none for DistilBERT (type_vocab_size 0)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h) if cfg.type_vocab_size else None
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        buckets = cfg.relative_attention_num_buckets
        self.relative_attention_bias = nn.Embedding(buckets, cfg.num_attention_heads) if buckets else None

    def forward(
        self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool = True, token_types: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden [b, n, h], token mask [b, n] bool); `token_types` [b, n] for text pairs."""
        n = ids.shape[1]
        positions = torch.arange(n, device=ids.device)
        token_mask = positions[None, :] < lengths[:, None]  # [b, n]
        x = self.word_embeddings(ids) + self.position_embeddings(positions + self.cfg.position_offset)
        if self.token_type_embeddings is not None and token_types is not None:
            x = x + self.token_type_embeddings(token_types)
        elif self.token_type_embeddings is not None:  # NOTE: single-segment input: token type 0 everywhere
            x = x + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        # A batch with no padding needs no mask, which lets SDPA pick its fastest kernel.
        attn_mask: torch.Tensor | None = token_mask[:, None, None, :] if padded else None
        if self.relative_attention_bias is not None:  # NOTE: one bias for every layer, the mask folded in
            attn_mask = self.position_bias(n, x.dtype, attn_mask)
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x, token_mask

    def position_bias(self, n: int, dtype: torch.dtype, mask: torch.Tensor | None) -> torch.Tensor:
        """MPNet's relative position bias [1 or b, heads, n, n], -inf where `mask` hides a key."""
        assert self.relative_attention_bias is not None
        positions = torch.arange(n, device=self.relative_attention_bias.weight.device)
        distance = positions[None, :] - positions[:, None]  # key minus query
        buckets = relative_position_bucket(distance, MPNET_BUCKETS)
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None].to(dtype)  # [1, heads, n, n]
        return bias if mask is None else bias.masked_fill(~mask, float("-inf"))

    def pack_for_cpu(self) -> BertEncoder:
        """Swaps every layer's linears for PackedLinear (fusing exact GELU into ffn_in)."""
        fuse = self.cfg.hidden_act == "gelu"
        pack_layers(self.layers, fuse_gelu="ffn_in" if fuse else None)
        if fuse:
            for layer in self.layers:
                layer.act = identity
        return self


# NOTE: transformers' MPNet buckets distances into 32 whatever its table's size (compute_position_bias's default)
MPNET_BUCKETS = 32


def relative_position_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int = 128) -> torch.Tensor:
    """MPNet's (T5's bidirectional) bucket of each key-minus-query distance: half the buckets per
    direction, exact up to a quarter of them, then logarithmic up to `max_distance`."""
    half = num_buckets // 2
    n = -relative
    bucket = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    far = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    far = far.clamp_max(half - 1)
    return bucket + torch.where(n < exact, n, far)


def bucket_rows(m: int) -> int:
    """The row count a oneDNN linear runs with: m rounded up to a coarse grid.

    NOTE: oneDNN builds (JIT-compiles) and keeps a kernel for every input shape it sees, a few
    hundred KiB each; token-budget batches have many distinct row counts (rows x padded length),
    so without a grid the process grew by ~0.5 GiB over a million rows. Multiples of 64 up to
    2048 rows, then 16 steps per doubling: a few dozen shapes per budget, at most ~6% padding
    on full batches.
    """
    if m <= 2048:
        return -(-m // 64) * 64
    step = 1 << (m.bit_length() - 5)  # m / 32 < step <= m / 16
    return -(-m // step) * step


class PackedLinear(nn.Module):
    """A CPU linear layer on oneDNN with its weight reordered once, optionally with an activation
    fused (`post`: oneDNN's name for it, "gelu" or "swish"; `algorithm`: "tanh" for GELU's tanh form).

    NOTE: the same math as nn.Linear (+ the activation) in float32, to rounding; on AVX-512 CPUs it
    is ~15% faster because the weight layout is prepared once instead of per call. Inputs are
    padded to `bucket_rows` rows so the number of distinct shapes, and oneDNN's kernel cache,
    stay bounded.
    """

    def __init__(self, linear: nn.Linear, post: str = "none", algorithm: str = "") -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.bias = linear.bias.detach() if linear.bias is not None else None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2048)
        self.post = (post, algorithm or ("none" if post == "gelu" else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op, algorithm = self.post
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        padded = bucket_rows(m)
        if padded != m:
            rows = torch.cat([rows, rows.new_zeros(padded - m, rows.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, op, [], algorithm)
        return out[:m].reshape(*x.shape[:-1], out.shape[-1])


def pack_layers(
    layers: nn.ModuleList,
    names: tuple[str, ...] = ("qkv", "attn_out", "ffn_in", "ffn_out"),
    fuse_gelu: str | None = None,
) -> None:
    """Each layer's linears `names` as PackedLinear, in place (exact GELU fused into `fuse_gelu`'s)."""
    for layer in layers:
        for name in names:
            setattr(layer, name, PackedLinear(getattr(layer, name), "gelu" if name == fuse_gelu else "none"))


@functools.cache
def onednn_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels here (its own check: AVX-512 CPUs, natively with AVX-512
    BF16 or AMX); elsewhere bfloat16 matmuls are emulated."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack_for_cpu(model: nn.Module) -> bool:
    """Whether a CPU model's linears can be oneDNN PackedLinears: every weight in float32, or in
    bfloat16 where oneDNN takes bfloat16 (its own check: AVX-512 CPUs, natively with AVX-512 BF16
    or AMX; torch's own bfloat16 linears ask the same)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    params = list(model.parameters())
    dtypes = {p.dtype for p in params}
    on_cpu = all(p.device.type == "cpu" for p in params)
    if dtypes == {torch.bfloat16}:
        return on_cpu and onednn_bfloat16()
    return on_cpu and dtypes == {torch.float32}


def pack_for_cpu(encoder: Any) -> Any:
    """The native encoder (any architecture: each has its own `pack_for_cpu`) on prepacked oneDNN linears."""
    return encoder.pack_for_cpu()


def identity(x: torch.Tensor) -> torch.Tensor:
    """A layer's activation once it is fused into its linear."""
    return x
