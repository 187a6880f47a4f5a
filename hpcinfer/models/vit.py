"""A native vision transformer: CLIP's and SigLIP's image towers, built from their weights.

The tower is built from the checkpoint's own files, with no transformers at all (models/vit_load.py),
and runs the same arithmetic as transformers' towers, faster:

- Q, K and V are one fused projection (one matrix product where there were three);
- on the CPU, in float32 (and in bfloat16 where oneDNN takes it: AVX-512 CPUs, natively with
  AVX-512 BF16 or AMX),
  every linear is a oneDNN linear with its weight reordered once (models/bert.py's `PackedLinear`),
  with the MLP's activation fused into its first product. CLIP's `quick_gelu`, x * sigmoid(1.702 x),
  is not an activation oneDNN has; it is `swish` (x * sigmoid(x)) of 1.702 x divided by 1.702, so
  the first MLP product's weights are scaled by 1.702 and the second's by 1 / 1.702 (a change of
  rounding only: in float32 at 1e-7, in bfloat16 at bfloat16's own precision), and it fuses too.

On 32 ViT-B/32 images (2 AVX-512 cores with AMX) that is 0.96-0.99 s a batch against transformers'
1.12-1.23 s in float32, and 0.19-0.21 against 0.24-0.25 s in bfloat16: transformers' float32
tower spent 14% of its time in the MLP's three activation kernels and 6% in copies
(benchmarks/speed/bench_images.py prints both towers' times).

An activation this module does not know leaves the checkpoint on transformers' tower, and so does
a SigLIP tower without its pooling head (vit_load.py's `vision_shape` says None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .bert import ACTIVATIONS as BERT_ACTIVATIONS
from .bert import PackedLinear, identity

QUICK_GELU = 1.702  # CLIP's quick_gelu: x * sigmoid(1.702 x)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(QUICK_GELU * x)


# hidden_act -> its eager form, and oneDNN's fused form as (post-op, algorithm)
ACTIVATIONS = {**BERT_ACTIVATIONS, "quick_gelu": _quick_gelu}
FUSED = {
    "quick_gelu": ("swish", ""),  # NOTE: with the weights scaled (module docstring)
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
}


@dataclass(frozen=True, slots=True)
class VitShape:
    """An image tower's sizes (from its tensors) and what its config says of the rest."""

    clip: bool
    hidden: int
    heads: int
    layers: int
    intermediate: int
    channels: int
    patch: int
    positions: int  # CLIP's class token's included
    projection: int  # CLIP's shared space; 0 for SigLIP (its pooling head's output is the embedding)
    act: str
    eps: float
    patch_bias: bool

    @property
    def image_size(self) -> int:
        patches = self.positions - (1 if self.clip else 0)
        return round(patches**0.5) * self.patch


class VitLayer(nn.Module):
    """A pre-norm encoder layer: x + attention(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, hidden: int, heads: int, intermediate: int, act: str, eps: float, causal: bool = False) -> None:
        """`causal`: each position attends to those before it (CLIP's text tower); else to all."""
        super().__init__()
        h = hidden
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.ffn_in, self.ffn_out = nn.Linear(h, intermediate), nn.Linear(intermediate, h)
        self.hidden_act = act
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # NOTE: an image has every patch
        x = x + self.attn_out(a.transpose(1, 2).reshape(b, n, h))
        return x + self.ffn_out(self.act(self.ffn_in(self.norm2(x))))

    def pack_for_cpu(self) -> None:
        """oneDNN linears, the activation fused into ffn_in's (quick_gelu as swish, weights scaled)."""
        post, algorithm = FUSED[self.hidden_act]
        if self.hidden_act == "quick_gelu":
            with torch.no_grad():
                self.ffn_in.weight.mul_(QUICK_GELU)
                if self.ffn_in.bias is not None:
                    self.ffn_in.bias.mul_(QUICK_GELU)
                self.ffn_out.weight.div_(QUICK_GELU)
        self.qkv, self.attn_out = PackedLinear(self.qkv), PackedLinear(self.attn_out)
        self.ffn_in, self.ffn_out = PackedLinear(self.ffn_in, post, algorithm), PackedLinear(self.ffn_out)
        self.act = identity


class HeadMlp(nn.Module):
    def __init__(self, shape: VitShape) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(shape.hidden, shape.intermediate), nn.Linear(shape.intermediate, shape.hidden)
        self.act = ACTIVATIONS[shape.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class AttentionPoolingHead(nn.Module):
    """SigLIP's pooling head: one learnt query (`probe`) attends over every patch, then a residual
    MLP; torch's own multi-head attention module, as transformers' head uses."""

    def __init__(self, shape: VitShape) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, shape.hidden))
        self.attention = nn.MultiheadAttention(shape.hidden, shape.heads, batch_first=True)
        self.layernorm = nn.LayerNorm(shape.hidden, eps=shape.eps)
        self.mlp = HeadMlp(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.attention(self.probe.expand(x.shape[0], -1, -1), x, x, need_weights=False)[0]
        return (pooled + self.mlp(self.layernorm(pooled)))[:, 0]


class VisionTower(nn.Module):
    """Pixel values [b, 3, height, width] -> the image embeddings `get_image_features` gives:
    CLIP's class token, normed and projected; SigLIP's attention-pooling head over every patch."""

    def __init__(self, shape: VitShape) -> None:
        super().__init__()
        h = shape.hidden
        self.shape, self.clip = shape, shape.clip
        self.patch = nn.Conv2d(shape.channels, h, shape.patch, stride=shape.patch, bias=shape.patch_bias)
        self.positions = nn.Embedding(shape.positions, h)
        self.class_embedding = nn.Parameter(torch.empty(h)) if shape.clip else None
        self.pre_norm = nn.LayerNorm(h, eps=shape.eps) if shape.clip else None
        self.layers = nn.ModuleList(
            VitLayer(h, shape.heads, shape.intermediate, shape.act, shape.eps) for _ in range(shape.layers)
        )
        self.post_norm = nn.LayerNorm(h, eps=shape.eps)
        self.projection = nn.Linear(h, shape.projection, bias=False) if shape.clip else None
        self.head = None if shape.clip else AttentionPoolingHead(shape)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # [b, patches, hidden]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.positions.weight[: x.shape[1]]
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for layer in self.layers:
            x = layer(x)
        if self.projection is not None:
            return self.projection(self.post_norm(x[:, 0]))
        assert self.head is not None
        return self.head(self.post_norm(x))

    def pack_for_cpu(self) -> VisionTower:
        for layer in self.layers:
            layer.pack_for_cpu()
        return self
