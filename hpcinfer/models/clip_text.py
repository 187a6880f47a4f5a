"""CLIP's and SigLIP's text towers, native, built from a checkpoint's own files (no transformers; a
sharded checkpoint stays on transformers' tower):
a text run of a CLIP / SigLIP model (the queries of an image search) no longer imports
transformers' CLIP modules, ~3.5 s of every such run's start on 2 cores.

The arithmetic is transformers' `CLIPTextModelWithProjection` / `SiglipTextModel`: token and
position embeddings, pre-norm encoder layers (models/vit.py's, causal for CLIP, bidirectional for
SigLIP), the final norm, then CLIP's end-of-text position projected (the first `eos_token_id`, or
the largest id where an old config's `eos_token_id` is 2, as transformers keeps it) or SigLIP's
last position through its head. CLIP's rows are right-padded, and causal attention keeps the
padding out of every real position; SigLIP's rows are padded to every position, as trained
(models/clip.py). An activation vit.py does not fuse leaves the checkpoint on transformers' tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from .meta import empty_modules
from .vit import FUSED, VitLayer
from .vit_load import adopt, layer_names, layer_state, load_tower, number

TEXT = "text_model."
CLIP_PROJECTION = "text_projection.weight"
# transformers' CLIPTextConfig / SiglipTextConfig defaults, for a config.json silent on them
TEXT_DEFAULTS = {
    "clip": {"num_hidden_layers": 12, "num_attention_heads": 8, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
             "eos_token_id": 49407},
    "siglip": {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_act": "gelu_pytorch_tanh",
               "layer_norm_eps": 1e-6},
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TextShape:
    clip: bool
    vocab: int
    positions: int
    hidden: int
    heads: int
    layers: int
    intermediate: int
    act: str
    eps: float
    out: int  # the embedding's size: CLIP's projection, SigLIP's head
    eos: int


class TextTower(nn.Module):
    """Token ids [rows, length] -> the text embeddings `get_text_features` gives."""

    def __init__(self, shape: TextShape) -> None:
        super().__init__()
        h = shape.hidden
        self.clip, self.eos = shape.clip, shape.eos
        self.token = nn.Embedding(shape.vocab, h)
        self.positions = nn.Embedding(shape.positions, h)
        self.layers = nn.ModuleList(
            VitLayer(h, shape.heads, shape.intermediate, shape.act, shape.eps, causal=shape.clip)
            for _ in range(shape.layers)
        )
        self.final_norm = nn.LayerNorm(h, eps=shape.eps)
        self.out = nn.Linear(h, shape.out, bias=not shape.clip)  # CLIP's projection, SigLIP's head

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = self.token(ids) + self.positions.weight[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        if not self.clip:
            return self.out(x[:, -1])  # NOTE: SigLIP pools the last position, padding or not
        valid = torch.ones_like(ids, dtype=torch.bool)
        if lengths is not None:
            valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        if self.eos == 2:  # NOTE: an old config's eos_token_id: transformers pools the largest id
            at = ids.masked_fill(~valid, -1).argmax(dim=-1)
        else:
            at = ((ids == self.eos) & valid).int().argmax(dim=-1)
        return self.out(x[torch.arange(ids.shape[0], device=ids.device), at])

    def pack_for_cpu(self) -> TextTower:
        for layer in self.layers:
            layer.pack_for_cpu()
        return self


def text_shape(model_type: str, settings: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> TextShape | None:
    """The text tower's shape from its tensors' shapes and its settings (vit_load's
    `tower_settings`); None for an activation vit.py does not fuse. A tensor it needs and `shapes`
    lacks, or sizes that do not fit, are a ModelError naming them."""
    clip = model_type == "clip"
    if str(settings["hidden_act"]) not in FUSED:
        return None
    layers = number(settings, "num_hidden_layers")
    out = CLIP_PROJECTION if clip else f"{TEXT}head.weight"
    needed = [f"{TEXT}embeddings.token_embedding.weight", f"{TEXT}embeddings.position_embedding.weight", out]
    needed += [f"{TEXT}final_layer_norm.{p}" for p in ("weight", "bias")] + layer_names(TEXT, layers)
    needed += [] if clip else [f"{TEXT}head.bias"]
    missing = [name for name in needed if name not in shapes]
    if missing:
        raise ModelError(f"the checkpoint lacks weights its text tower needs: {missing[0]}")
    vocab, hidden = shapes[f"{TEXT}embeddings.token_embedding.weight"]
    heads = number(settings, "num_attention_heads")
    if heads <= 0 or hidden % heads:
        raise ModelError(f"the text tower's {hidden} hidden units do not divide into {heads} heads")
    eos = settings.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if clip and not isinstance(eos, int):
        raise ModelError(f"the text config's eos_token_id is {eos!r}: CLIP pools its text at that token")
    return TextShape(
        clip=clip,
        vocab=vocab,
        positions=shapes[f"{TEXT}embeddings.position_embedding.weight"][0],
        hidden=hidden,
        heads=heads,
        layers=layers,
        intermediate=shapes[f"{TEXT}encoder.layers.0.mlp.fc1.weight"][0] if layers else 0,
        act=str(settings["hidden_act"]),
        eps=number(settings, "layer_norm_eps", float),
        out=shapes[out][0],
        eos=eos if isinstance(eos, int) else -1,  # NOTE: SigLIP pools the last place, whatever the token
    )


def text_state(weights: Mapping[str, torch.Tensor], shape: TextShape) -> dict[str, torch.Tensor]:
    state = layer_state(weights, TEXT, shape.layers)
    state["token.weight"] = weights[f"{TEXT}embeddings.token_embedding.weight"]
    state["positions.weight"] = weights[f"{TEXT}embeddings.position_embedding.weight"]
    for p in ("weight", "bias"):
        state[f"final_norm.{p}"] = weights[f"{TEXT}final_layer_norm.{p}"]
    if shape.clip:
        state["out.weight"] = weights[CLIP_PROJECTION]
    else:
        state["out.weight"], state["out.bias"] = weights[f"{TEXT}head.weight"], weights[f"{TEXT}head.bias"]
    return state


def load_text_tower(
    path: Path, raw_config: Mapping[str, Any], device: torch.device, dtype: torch.dtype, cpu_fast_path: bool
) -> TextTower | None:
    """A CLIP / SigLIP checkpoint's text tower, native, from its files alone; None where it cannot
    be (then transformers' tower runs)."""
    kind = str(raw_config.get("model_type"))

    def build(settings: dict[str, Any], weights: dict[str, torch.Tensor]) -> TextTower | None:
        shape = text_shape(kind, settings, {k: tuple(v.shape) for k, v in weights.items()})
        if shape is None:
            return None
        with empty_modules():
            tower = TextTower(shape)
        return adopt(tower, text_state(weights, shape), device, dtype, cpu_fast_path)

    defaults = TEXT_DEFAULTS["clip" if kind == "clip" else "siglip"]
    runs = lambda settings: str(settings["hidden_act"]) in FUSED  # noqa: E731
    return load_tower(path, raw_config, "text_config", defaults, runs, TEXT, CLIP_PROJECTION, build)
