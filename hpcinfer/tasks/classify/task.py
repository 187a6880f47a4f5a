"""The classify task: a `*ForSequenceClassification` checkpoint labels each row, on the encoder pipeline."""

from __future__ import annotations

from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ...files.parts import PartStore
from ...files.sources import Source
from ...models.checkpoint import CheckpointInfo
from ...pipeline.labels import LabelStore
from ...pipeline.task import EncoderTask, openai_output
from ...registry import Checkpoint


class ClassifyTask(EncoderTask):
    name = "classify"
    own = ("classify.all_scores",)

    def claims(self, checkpoint: Checkpoint) -> str | None:
        arch = checkpoint.architecture
        if arch.endswith("ForSequenceClassification") and (labels := checkpoint.label_count) > 1:
            return f"a {arch} with {labels} labels"
        return None

    def store(
        self, config: RunConfig, fmt: str, info: CheckpointInfo, fp: dict[str, Any], sources: list[Source]
    ) -> PartStore:
        if any(s.fmt == "openai" for s in sources) and openai_output(sources, fmt):
            raise ConfigError(
                "an OpenAI batch file holds /v1/embeddings, /v1/score or /v1/rerank requests: "
                "run it with --task embed or --task score"
            )
        return LabelStore(config.output.path, fmt, info, fp, config.classify.all_scores)

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        return {"task": self.name, "all_scores": config.classify.all_scores, "pairs": list(config.input.pair_columns)}


TASK = ClassifyTask()
