"""The sparse task: a SPLADE checkpoint (sentence-transformers' MLMTransformer + SpladePooling) gives
every row a vocabulary-wide vector, written as its non-zero entries, on the encoder pipeline (its
model, model.py; its rows, store.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ...files.parts import PartStore
from ...files.sources import Source
from ...models.checkpoint import CheckpointInfo
from ...models.registry import resolve_model_path
from ...pipeline.task import EncoderTask, openai_output, window_cut
from ...registry import Checkpoint
from .checkpoint import inspect_splade, is_splade
from .store import SparseVectorStore


class SparseTask(EncoderTask):
    name = "sparse"
    # NOTE: --max-active-dims keeps each row's k largest entries, as SparseEncoder.encode's
    # max_active_dims; 0 keeps the checkpoint's own max_active_dims
    own = ("sparse.max_active_dims",)

    transformers_path = False  # native only: --backend auto runs it natively or refuses it

    def claims(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.sentence_transformers and is_splade(checkpoint.path):
            return "sentence-transformers MLMTransformer + SpladePooling modules: a sparse (SPLADE) embedding"
        return None

    def hints(self) -> dict[str, str]:
        pooled = "the checkpoint's SpladePooling pools (a dense vector is --task embed's)"
        kept = "--max-active-dims keeps each row's largest entries (--top-k samples generation's tokens)"
        return {
            **super().hints(),
            "embed.pooling": pooled,
            "embed.normalize": pooled,
            "embed.dimensions": pooled,
            "generate.top_k": kept,
        }

    def settle(self, config: RunConfig) -> RunConfig:
        config = super().settle(config)
        if config.backend == "transformers":
            raise ConfigError(
                "--task sparse runs hpcinfer's own BERT encoder and MLM head; drop --backend transformers"
            )
        if config.device.quantize != "none":
            raise ConfigError(
                "--task sparse runs float weights (int8 is checked on dense embeddings only); drop --quantize"
            )
        return window_cut(config, self.inspect(resolve_model_path(config.model), config))

    def inspect(self, path: Path, config: RunConfig) -> CheckpointInfo:
        info = inspect_splade(path)
        if config.sparse.max_active_dims:
            return replace(info, head=replace(info.head, top_k=config.sparse.max_active_dims))
        return info

    def store(
        self, config: RunConfig, fmt: str, info: CheckpointInfo, fp: dict[str, Any], sources: list[Source]
    ) -> PartStore:
        if any(s.fmt == "openai" for s in sources) and openai_output(sources, fmt):
            raise ConfigError("an OpenAI batch file has no sparse-embedding endpoint: give JSONL or Parquet rows")
        return SparseVectorStore(config.output.path, fmt, info, fp)

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        # NOTE: the pooling's settings live in the checkpoint's files, which the weights' digest does not cover
        head = self.inspect(resolve_model_path(config.model), config).head
        return {"task": self.name, "splade": [head.strategy, head.activation, head.top_k], "outputs": "ragged"}


TASK = SparseTask()
