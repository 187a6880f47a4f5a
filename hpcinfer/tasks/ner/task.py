"""The ner task: a `*ForTokenClassification` checkpoint labels every token of a row, on the encoder
pipeline (its model, model.py; its rows, store.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ...files.parts import PartStore
from ...files.sources import Source
from ...models.checkpoint import CheckpointInfo
from ...pipeline.task import EncoderTask, openai_output
from ...registry import Checkpoint
from .model import inspect_token_classifier
from .store import TokenLabelStore


class NerTask(EncoderTask):
    name = "ner"

    transformers_path = False  # native only: --backend auto runs it natively or refuses it

    def claims(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.architecture.endswith("ForTokenClassification"):
            return f"a {checkpoint.architecture}: a label per token"
        return None

    def settle(self, config: RunConfig) -> RunConfig:
        config = super().settle(config)
        if config.backend == "transformers":
            raise ConfigError("--task ner runs hpcinfer's own BERT-family encoders; drop --backend transformers")
        if config.device.quantize != "none":
            raise ConfigError("--task ner runs float weights (int8 is checked by embeddings' cosine); drop --quantize")
        return config

    def inspect(self, path: Path, config: RunConfig) -> CheckpointInfo:
        return inspect_token_classifier(path, config.tokenize.max_length)

    def store(
        self, config: RunConfig, fmt: str, info: CheckpointInfo, fp: dict[str, Any], sources: list[Source]
    ) -> PartStore:
        if any(s.fmt == "openai" for s in sources) and openai_output(sources, fmt):
            raise ConfigError("an OpenAI batch file has no token-classification endpoint: give JSONL or Parquet rows")
        return TokenLabelStore(config.output.path, fmt, info, fp)

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        return {"task": self.name, "outputs": "ragged"}


TASK = NerTask()
