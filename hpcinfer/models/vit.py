"""A native vision transformer: CLIP's and SigLIP's image towers, built from transformers' modules.

transformers' towers (`CLIPVisionModelWithProjection`, `SiglipVisionModel`) are loaded as they are
(so every checkpoint layout they read, sentence-transformers' CLIP folders included, loads), then
their weights are taken into this module, which runs the same arithmetic faster:

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

An activation this module does not know leaves the checkpoint on transformers' tower (`native_tower`
returns None).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .bert import ACTIVATIONS as BERT_ACTIVATIONS
from .bert import PackedLinear, can_pack_for_cpu, identity

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


def _fused_qkv(attention: Any) -> nn.Linear:
    """Q, K and V as one linear, on their device in their dtype (no float32 copy made on the way)."""
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    fused = torch.nn.utils.skip_init(
        nn.Linear, q.in_features, 3 * q.out_features, bias=q.bias is not None, device=q.weight.device,
        dtype=q.weight.dtype,
    )  # fmt: skip
    with torch.no_grad():
        fused.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
    return fused


class VitLayer(nn.Module):
    """A pre-norm encoder layer: x + attention(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, layer: Any, hidden_act: str) -> None:
        """Takes `layer`'s modules out of it (transformers' layer is left empty), so that the
        weights this layer replaces, Q/K/V now and each linear when packed, are freed at once
        instead of staying alive in transformers' tower until the load ends."""
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.heads = attention.num_heads
        self.norm1, self.norm2 = layer.layer_norm1, layer.layer_norm2
        self.qkv = _fused_qkv(attention)
        self.attn_out = attention.out_proj
        self.ffn_in, self.ffn_out = mlp.fc1, mlp.fc2
        attention.q_proj = attention.k_proj = attention.v_proj = attention.out_proj = None
        mlp.fc1 = mlp.fc2 = None
        self.hidden_act = hidden_act
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)  # NOTE: every image has every patch: no mask
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


class VisionTower(nn.Module):
    """Pixel values [b, 3, height, width] -> the image embeddings `get_image_features` gives:
    CLIP's class token, normed and projected; SigLIP's attention-pooling head over every patch."""

    def __init__(self, tower: Any, clip: bool) -> None:
        super().__init__()
        vision = tower.vision_model if clip else tower
        config = vision.config
        self.clip = clip
        self.patch = vision.embeddings.patch_embedding
        self.positions = vision.embeddings.position_embedding
        self.class_embedding = vision.embeddings.class_embedding if clip else None
        self.pre_norm = vision.pre_layrnorm if clip else None
        self.layers = nn.ModuleList(VitLayer(layer, config.hidden_act) for layer in vision.encoder.layers)
        self.post_norm = vision.post_layernorm
        self.projection = tower.visual_projection if clip else None
        self.head = None if clip else vision.head  # NOTE: one query per image: transformers' own module

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # [b, patches, hidden]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.positions.weight[: x.shape[1]]
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for layer in self.layers:
            x = layer(x)
        if self.clip:
            assert self.projection is not None
            return self.projection(self.post_norm(x[:, 0]))
        return self.head(self.post_norm(x))

    def pack_for_cpu(self) -> VisionTower:
        for layer in self.layers:
            layer.pack_for_cpu()
        return self


def native_tower(tower: Any, model_type: str, cpu_fast_path: bool) -> VisionTower | None:
    """The native tower of transformers' CLIP / SigLIP image tower (on its device, in its dtype),
    packed for the CPU where `cpu_fast_path` and the dtype allow (`can_pack_for_cpu`); None where it has an
    activation this module does not know, or (SigLIP) no pooling head."""
    clip = model_type == "clip"
    config = (tower.vision_model if clip else tower).config
    if config.hidden_act not in FUSED or (not clip and not getattr(config, "vision_use_head", True)):
        return None
    native = VisionTower(tower, clip).eval()
    if cpu_fast_path and can_pack_for_cpu(native):
        native.pack_for_cpu()
    return native
