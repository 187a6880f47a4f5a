"""The BERT-shaped architectures on models/bert.py's encoder: how each reads its config.json and
names its weights.

- BERT (MiniLM, BGE, E5, ...): the reference.
- RoBERTa, XLM-R, CamemBERT: positions counted from padding_idx + 1, one token type.
- DistilBERT: its own config and weight names, no token types.
- MPNet: positions from padding_idx + 1 (its padding_idx is always 1), no token types, and a
  learned relative position bias (32 buckets) that every layer adds to its attention scores.
Each becomes BERT's names first, then `BertEncoder`'s, with Q, K and V fused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import UnsupportedModel
from .bert import ACTIVATIONS, BertConfig, BertEncoder
from .weight_names import renamed

_PREFIX = re.compile(r"^(bert|roberta|distilbert|mpnet|model)\.")
_RENAMES = [
    (r"^embeddings\.word_embeddings\.", "word_embeddings."),
    (r"^embeddings\.position_embeddings\.", "position_embeddings."),
    (r"^embeddings\.token_type_embeddings\.", "token_type_embeddings."),
    (r"^embeddings\.LayerNorm\.", "embed_norm."),
    (r"^encoder\.relative_attention_bias\.", "relative_attention_bias."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn_out."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
]
_QKV = re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")
_IGNORED = re.compile(r"^(pooler\.|embeddings\.position_ids$|embeddings\.token_type_ids$|cls\.|lm_head\.)")

_DISTILBERT_NAMES = (  # DistilBERT's names -> BERT's
    (r"^transformer\.layer\.(\d+)\.attention\.q_lin\.", r"encoder.layer.\1.attention.self.query."),
    (r"^transformer\.layer\.(\d+)\.attention\.k_lin\.", r"encoder.layer.\1.attention.self.key."),
    (r"^transformer\.layer\.(\d+)\.attention\.v_lin\.", r"encoder.layer.\1.attention.self.value."),
    (r"^transformer\.layer\.(\d+)\.attention\.out_lin\.", r"encoder.layer.\1.attention.output.dense."),
    (r"^transformer\.layer\.(\d+)\.sa_layer_norm\.", r"encoder.layer.\1.attention.output.LayerNorm."),
    (r"^transformer\.layer\.(\d+)\.ffn\.lin1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"^transformer\.layer\.(\d+)\.ffn\.lin2\.", r"encoder.layer.\1.output.dense."),
    (r"^transformer\.layer\.(\d+)\.output_layer_norm\.", r"encoder.layer.\1.output.LayerNorm."),
)
_MPNET_NAMES = (  # MPNet's names -> BERT's
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.q\.", r"encoder.layer.\1.attention.self.query."),
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.k\.", r"encoder.layer.\1.attention.self.key."),
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.v\.", r"encoder.layer.\1.attention.self.value."),
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.o\.", r"encoder.layer.\1.attention.output.dense."),
    (r"^encoder\.layer\.(\d+)\.attention\.LayerNorm\.", r"encoder.layer.\1.attention.output.LayerNorm."),
)


def _distilbert_config(raw: dict[str, Any]) -> dict[str, Any]:
    """DistilBERT's config.json under BERT's field names (no token types)."""
    return {
        "model_type": "distilbert",
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["dim"],
        "num_hidden_layers": raw["n_layers"],
        "num_attention_heads": raw["n_heads"],
        "intermediate_size": raw["hidden_dim"],
        "max_position_embeddings": raw["max_position_embeddings"],
        "hidden_act": raw.get("activation", "gelu"),
        "pad_token_id": raw.get("pad_token_id", 0),
        "type_vocab_size": 0,
        "layer_norm_eps": 1e-12,
    }


@dataclass(frozen=True, slots=True)
class BertShaped:
    """An `encoders.Architecture` on `BertEncoder`: `positions`: 'absolute' (BERT, DistilBERT),
    'after_padding' (from padding_idx + 1) or 'mpnet' (from 2, with the relative bias);
    `names`: the family's weight names -> BERT's."""

    positions: str = "absolute"
    names: tuple[tuple[str, str], ...] = ()
    distilbert: bool = False

    def config(self, raw: dict[str, Any]) -> BertConfig:
        """Raises KeyError / TypeError for a config.json that lacks a field."""
        config = BertConfig.from_hf(_distilbert_config(raw) if self.distilbert else raw)
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} (native: {', '.join(ACTIVATIONS)})")
        if self.positions == "after_padding":
            config = replace(config, position_offset=int(raw.get("pad_token_id", 1)) + 1)
        elif self.positions == "mpnet":  # NOTE: transformers' MPNet counts from its fixed padding_idx 1
            buckets = int(raw.get("relative_attention_num_buckets", 32))
            config = replace(config, position_offset=2, type_vocab_size=0, relative_attention_num_buckets=buckets)
        return config

    def build(self, config: BertConfig) -> BertEncoder:
        return BertEncoder(config)

    def rename(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under `BertEncoder`'s names, Q, K and V fused (others dropped)."""
        state: dict[str, torch.Tensor] = {}
        qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for name, tensor in weights.items():
            name = _PREFIX.sub("", name).replace(".gamma", ".weight").replace(".beta", ".bias")
            name = renamed(name, self.names) or name  # NOTE: the family's names become BERT's first
            if _IGNORED.match(name):
                continue
            if m := _QKV.match(name):
                qkv.setdefault((m[1], m[3]), {})[m[2]] = tensor
            elif (new := renamed(name, _RENAMES)) is not None:
                state[new] = tensor
        for (layer, kind), parts in qkv.items():
            if len(parts) == 3:  # NOTE: a part missing leaves qkv missing: the loader names it
                state[f"layers.{layer}.qkv.{kind}"] = torch.cat([parts["query"], parts["key"], parts["value"]])
        return state


BERT = BertShaped()
ROBERTA = BertShaped(positions="after_padding")
DISTILBERT = BertShaped(names=_DISTILBERT_NAMES, distilbert=True)
MPNET = BertShaped(positions="mpnet", names=_MPNET_NAMES)

__all__ = ["BERT", "DISTILBERT", "MPNET", "ROBERTA", "BertShaped"]
