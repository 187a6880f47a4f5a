"""One rank's shard of a safetensors checkpoint, read slice by slice: no rank holds the whole model.

Each tensor is read with safetensors' `get_slice`, which reads only the rows (or columns) asked
for from the file's memory map: q/k/v and gate/up by rows (this rank's heads, this rank's MLP
slice), o_proj and down by columns, the embedding and LM head by vocabulary rows (or whole, when
replicated), norms whole. At most one layer's q/k/v (or gate/up) slices are held twice, while
they are fused into the layer's one matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open

from ..errors import ConfigError, ModelError
from ..models.decoder_checkpoint import assign_weights
from ..models.decoder_inspect import DecoderInfo
from ..models.meta import empty_modules
from .decoder import ShardedDecoder, rank_config, vocab_rows
from .group import Collectives

Slicer = Callable[[Any], torch.Tensor]  # a safetensors slice -> the rows or columns this rank holds


def _rows(start: int, stop: int) -> Slicer:
    return lambda s: s[start:stop]


def _cols(start: int, stop: int) -> Slicer:
    return lambda s: s[:, start:stop]


def _whole(s: Any) -> torch.Tensor:
    return s[:]


class _Checkpoint:
    """The checkpoint's tensors by HF name, across its shard files (opened once, memory-mapped);
    each slice read goes straight to the run's device and dtype."""

    def __init__(self, info: DecoderInfo, stack: ExitStack, device: torch.device, dtype: torch.dtype) -> None:
        self.path, self.device, self.dtype = info.path, device, dtype
        self.files: dict[str, Any] = {}
        for file in info.weight_files:
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise ModelError(f"cannot load weights ({exc})", path=str(file)) from None
            self.files |= dict.fromkeys(handle.keys(), handle)
        self.prefix = "model." if any(k.startswith("model.") for k in self.files) else ""

    def has(self, name: str) -> bool:
        return self._key(name) in self.files

    def read(self, name: str, take: Slicer) -> torch.Tensor:
        key = self._key(name)
        if key not in self.files:
            raise ModelError(f"weights are missing {key}", path=str(self.path))
        return take(self.files[key].get_slice(key)).to(device=self.device, dtype=self.dtype)

    def _key(self, name: str) -> str:
        return name if name == "lm_head.weight" else self.prefix + name


def shard_tensors(ckpt: _Checkpoint, model: ShardedDecoder) -> dict[str, torch.Tensor]:
    """The rank's tensors under the sharded model's names (q/k/v and gate/up fused)."""
    full, cfg, rank, world = model.full, model.cfg, model.comm.rank, model.comm.world
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    q_all, kv_all, inter_all = full.num_heads * full.head_dim, full.num_kv_heads * full.head_dim, full.intermediate_size
    state: dict[str, torch.Tensor] = {}
    for i in range(full.num_layers):
        hf, ours = f"layers.{i}.", f"layers.{i}."
        if ckpt.has(f"{hf}self_attn.qkv_proj.weight"):  # phi3: q/k/v and gate/up stored fused
            qkv, gate_up = [q_all, kv_all, kv_all], [inter_all, inter_all]
            state[f"{ours}qkv.weight"] = _fused_rows(ckpt, f"{hf}self_attn.qkv_proj.weight", qkv, rank, world)
            state[f"{ours}gate_up.weight"] = _fused_rows(ckpt, f"{hf}mlp.gate_up_proj.weight", gate_up, rank, world)
        else:
            for kind in ["weight"] + (["bias"] if cfg.qkv_bias else []):
                state[f"{ours}qkv.{kind}"] = torch.cat(
                    [
                        ckpt.read(f"{hf}self_attn.q_proj.{kind}", _rows(rank * q, (rank + 1) * q)),
                        ckpt.read(f"{hf}self_attn.k_proj.{kind}", _rows(rank * kv, (rank + 1) * kv)),
                        ckpt.read(f"{hf}self_attn.v_proj.{kind}", _rows(rank * kv, (rank + 1) * kv)),
                    ]
                )
            for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
                state[f"{ours}gate_up.{kind}"] = torch.cat(
                    [
                        ckpt.read(f"{hf}mlp.gate_proj.{kind}", _rows(rank * inter, (rank + 1) * inter)),
                        ckpt.read(f"{hf}mlp.up_proj.{kind}", _rows(rank * inter, (rank + 1) * inter)),
                    ]
                )
                if kind == "bias":
                    state[f"{ours}down.bias"] = ckpt.read(f"{hf}mlp.down_proj.bias", _whole)
        state[f"{ours}o_proj.weight"] = ckpt.read(f"{hf}self_attn.o_proj.weight", _cols(rank * q, (rank + 1) * q))
        state[f"{ours}down.weight"] = ckpt.read(f"{hf}mlp.down_proj.weight", _cols(rank * inter, (rank + 1) * inter))
        if cfg.o_bias:
            state[f"{ours}o_proj.bias"] = ckpt.read(f"{hf}self_attn.o_proj.bias", _whole)
        state[f"{ours}input_norm"] = ckpt.read(f"{hf}input_layernorm.weight", _whole)
        if cfg.sandwich_norms:  # Gemma: the norm before the MLP, and one after each of attention and MLP
            state[f"{ours}post_norm"] = ckpt.read(f"{hf}pre_feedforward_layernorm.weight", _whole)
            state[f"{ours}attn_out_norm"] = ckpt.read(f"{hf}post_attention_layernorm.weight", _whole)
            state[f"{ours}mlp_out_norm"] = ckpt.read(f"{hf}post_feedforward_layernorm.weight", _whole)
        else:
            state[f"{ours}post_norm"] = ckpt.read(f"{hf}post_attention_layernorm.weight", _whole)
        if cfg.qk_norm:
            state[f"{ours}q_norm"] = ckpt.read(f"{hf}self_attn.q_norm.weight", _whole)
            state[f"{ours}k_norm"] = ckpt.read(f"{hf}self_attn.k_norm.weight", _whole)
    state["norm"] = ckpt.read("norm.weight", _whole)
    if cfg.sandwich_norms:  # Gemma's norms scale by (1 + weight), as decoder_checkpoint.native_state_dict says
        for name in [n for n in state if n == "norm" or n.endswith("_norm")]:
            state[name] = (state[name].float() + 1.0).to(state[name].dtype)
    state["embed.weight"] = _vocab(ckpt, "embed_tokens.weight", model)
    if not cfg.tie_word_embeddings:
        # some checkpoints omit a head equal to the embedding
        head = "lm_head.weight" if ckpt.has("lm_head.weight") else "embed_tokens.weight"
        state["lm_head.weight"] = _vocab(ckpt, head, model)
    return state


def _fused_rows(ckpt: _Checkpoint, name: str, parts: list[int], rank: int, world: int) -> torch.Tensor:
    """This rank's rows of each part of a fused tensor (q, k, v or gate, up: `parts` rows each, one
    after another in the file), each part split evenly across the `world` ranks."""
    pieces, offset = [], 0
    for rows in parts:
        share = rows // world
        pieces.append(ckpt.read(name, _rows(offset + rank * share, offset + (rank + 1) * share)))
        offset += rows
    return torch.cat(pieces)


def _vocab(ckpt: _Checkpoint, name: str, model: ShardedDecoder) -> torch.Tensor:
    """The embedding's (or head's) rows this rank holds, padded with zero rows to vocab/N; whole when replicated."""
    if not model.vocab_parallel:
        return ckpt.read(name, _whole)
    first, held, rows = vocab_rows(model.cfg.vocab_size, model.comm.rank, model.comm.world)
    part = ckpt.read(name, _rows(first, first + held))
    if held == rows:
        return part
    return torch.cat([part, part.new_zeros(rows - held, part.shape[1])])


def load_shard(
    info: DecoderInfo, comm: Collectives, device: torch.device, dtype: torch.dtype, vocab_parallel: bool = True
) -> ShardedDecoder:
    """This rank's ShardedDecoder on `device` in `dtype`; strict about missing and misshapen tensors."""
    if info.gguf:
        raise ConfigError("--tp reads safetensors checkpoints; run a GGUF file with --tp 1")
    rank_config(info.config, comm.world)  # NOTE: a ConfigError before any weight is read
    with empty_modules():
        model = ShardedDecoder(info.config, comm, vocab_parallel)
    with ExitStack() as stack:
        state = shard_tensors(_Checkpoint(info, stack, device, dtype), model)
    return assign_weights(model, state, info.path)
