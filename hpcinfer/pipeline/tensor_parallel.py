"""`--tp N` for a decoder embedder (`--task embed` on a Llama/Qwen-family checkpoint): the decoder
split across N ranks as generation splits it (parallel/), inside the ordinary embedding pipeline.

Rank 0 is this process: it reads, tokenizes, batches and writes as a run without --tp does, and
computes on its shard; before each batch's forward it sends the batch's ids to ranks 1..N-1
(their stdin, as generation sends its steps: parallel/tp.py), which run the same decoder
forward on their shards so that every all-reduce pairs up. The final norm and the pooling run on
rank 0 alone (the hidden states after the last all-reduce are whole on every rank).
"""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..device import Device
from ..models.checkpoint import CheckpointInfo
from ..models.decoder_embedder import DecoderEmbedder
from ..models.registry import LoadedModel
from ..parallel.tp import DEFAULT_TIMEOUT_S, EmbedBatch, RankSetup, TensorParallel, start_tensor_parallel
from ..parallel.tp_groups import rank_threads, tensor_groups

KV_STUB_BYTES = 4 << 20  # the ranks' KV pool: a pooling forward reads none (generation's rank code sizes one)


class TensorParallelEmbedder(DecoderEmbedder):
    """Rank 0's decoder embedder: each forward is announced to the other ranks first."""

    def __init__(self, tp: TensorParallel, info: CheckpointInfo, dtype: torch.dtype) -> None:
        super().__init__(tp.model, info.pooling, dtype)
        self.tp = tp
        self.batches = 0

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        self.tp.ranks.send_batch(EmbedBatch(ids.detach().cpu()))
        self.batches += 1
        return super().forward(ids, lengths, padded)


def refusal(config: RunConfig, info: CheckpointInfo, devices: list[Device]) -> str | None:
    """Why `--tp` cannot run this pooling job, or None (what generation refuses too: tp_groups.py)."""
    n = config.device.tensor_parallel
    if info.decoder is None:
        return f"--tp {n} splits a decoder; this checkpoint is an encoder (run it with --tp 1)"
    if config.backend == "transformers":
        return "--tp runs hpcinfer's own decoder, not --backend transformers"
    if len(devices) > 1:
        return "--tp with --devices runs generation; a pooling task runs one tensor-parallel group"
    tensor_groups(config, info.decoder, [devices[0].torch_device])  # NOTE: raises the refusals they share
    return None


def start_embedding_group(
    config: RunConfig, info: CheckpointInfo, device: Device, dtype: torch.dtype
) -> tuple[LoadedModel, TensorParallel, int | None]:
    """Starts ranks 1..N-1 and loads rank 0's shard: (rank 0's model, the group, each CPU rank's threads)."""
    groups = tensor_groups(config, info.decoder, [device.torch_device])
    threads = rank_threads(config, groups)
    setup = RankSetup(
        info=info.decoder,
        devices=tuple(str(d) for d in groups[0]),
        dtype=dtype,
        port=0,
        timeout_s=config.device.step_timeout or DEFAULT_TIMEOUT_S,
        threads=threads,
        kv_memory=KV_STUB_BYTES,
        block_size=16,
        kv_storage=None,
        max_num_batched_tokens=16,
        max_num_seqs=1,
        attention="torch",
    )
    tp = start_tensor_parallel(setup)
    tp.model.lm_head = None  # NOTE: an embedder reads hidden states: rank 0's vocabulary rows are dead weight
    return LoadedModel(info, TensorParallelEmbedder(tp, info, dtype)), tp, threads


__all__ = ["TensorParallelEmbedder", "refusal", "start_embedding_group"]
