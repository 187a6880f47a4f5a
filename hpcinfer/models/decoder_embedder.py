"""Sentence embeddings from a Llama-family decoder (Qwen3-Embedding, gte-Qwen2, e5-mistral and the
like): the native decoder over a padded batch, no KV cache, then the checkpoint's pooling.

It is a `BatchModel` like the BERT embedder, so it runs in the same pipeline (token-budget
batches, staging, the multi-stream executor, windows, resume). Rows are padded on the right and
attention is causal, so a row's real tokens never see its padding and each row's hidden states
are those of the row alone: last-token pooling takes the last real token (as sentence-transformers'
`lasttoken` pooling finds it from the attention mask, whichever side the tokenizer pads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .adapter import SentenceEmbedder
from .bert import PackedLinear, can_pack_for_cpu
from .checkpoint import PoolingSpec
from .decoder_checkpoint import load_decoder
from .llama import LlamaDecoder, rms_norm


class PaddedCausalAttention:
    """Causal attention within each row of a right-padded [rows, width] batch, flattened to T = rows x width."""

    def __init__(self, rows: int, width: int) -> None:
        self.rows, self.width = rows, width

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def heads(x: torch.Tensor) -> torch.Tensor:  # [T, h, d] -> [rows, h, width, d]
            return x.view(self.rows, self.width, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], -1)


def pack_decoder_for_cpu(decoder: LlamaDecoder) -> LlamaDecoder:
    """Every layer's linears as oneDNN linears with their weights reordered once (as the BERT
    encoder's on CPU): embedding batches are thousands of tokens, where the one-off layout pays."""
    for layer in decoder.layers:
        layer.qkv = PackedLinear(layer.qkv)
        layer.o_proj = PackedLinear(layer.o_proj)
        layer.gate_up = PackedLinear(layer.gate_up)
        layer.down = PackedLinear(layer.down)
    return decoder


def padded_hidden(decoder: LlamaDecoder, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's hidden states [rows * width, hidden] of right-padded rows ids [rows, width]
    (a tensor-parallel rank replays exactly this on its shard: parallel/embed_rank)."""
    rows, width = ids.shape
    positions = torch.arange(width, device=ids.device).repeat(rows)
    return decoder(ids.reshape(-1), positions, PaddedCausalAttention(rows, width))


@dataclass(frozen=True, slots=True)
class DecoderPoolingHead:
    """heads.Head: a Llama-family decoder's hidden states pooled as `info.pooling` says (`info.decoder`:
    its DecoderInfo)."""

    ragged = None

    def width(self, info: Any) -> int:
        return info.pooling.dimensions or info.config.hidden_size

    def load(self, info: Any, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool) -> DecoderEmbedder:
        decoder = load_decoder(info.decoder, device, dtype)
        decoder.lm_head = None  # NOTE: an embedder reads hidden states: the vocabulary head is dead weight
        if cpu_fast_path and can_pack_for_cpu(decoder):
            decoder = pack_decoder_for_cpu(decoder)
        return DecoderEmbedder(decoder, info.pooling, dtype)


class DecoderEmbedder(SentenceEmbedder):
    """Decoder + final norm + pooling (+ Matryoshka truncation, + L2 normalisation): the sentence
    embedder's steps with the decoder's forward."""

    def __init__(self, decoder: LlamaDecoder, pooling: PoolingSpec, dtype: torch.dtype) -> None:
        super().__init__(decoder, pooling, dtype)  # type: ignore[arg-type]
        self.decoder = decoder

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        rows, width = ids.shape
        hidden = padded_hidden(self.decoder, ids)
        hidden = rms_norm(hidden, self.decoder.norm, self.decoder.cfg.rms_norm_eps).view(rows, width, -1)
        token_mask = torch.arange(width, device=ids.device)[None, :] < lengths[:, None]
        return hidden, token_mask


__all__ = ["DecoderEmbedder", "DecoderPoolingHead", "PaddedCausalAttention", "pack_decoder_for_cpu", "padded_hidden"]
