"""The score task: a cross-encoder (a one-label sequence classifier) scores each row's text pair."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...config import RunConfig
from ...files.parts import PartStore
from ...files.sources import Source
from ...models.checkpoint import CheckpointInfo
from ...pipeline.labels import LabelStore
from ...pipeline.task import EncoderTask, openai_output
from ...registry import Checkpoint
from .answers import ScoreAnswerStore
from .pairs import with_pair_columns


class ScoreTask(EncoderTask):
    name = "score"
    own = ("input.pair_columns",)
    endpoints = ("/v1/score", "/v1/rerank")

    def claims(self, checkpoint: Checkpoint) -> str | None:
        arch = checkpoint.architecture
        if arch.endswith("ForSequenceClassification") and checkpoint.label_count == 1:
            return f"a {arch} with one label: a cross-encoder"
        return None

    def honours(self, config: RunConfig) -> Iterable[str]:
        return [f for f in super().honours(config) if f != "input.text_column"]  # NOTE: the pair's columns instead

    def hints(self) -> dict[str, str]:
        return super().hints() | {"input.text_column": "a pair's two columns are --pair-columns A,B"}

    def settle(self, config: RunConfig) -> RunConfig:
        return with_pair_columns(super().settle(config))

    def store(
        self, config: RunConfig, fmt: str, info: CheckpointInfo, fp: dict[str, Any], sources: list[Source]
    ) -> PartStore:
        if openai_output(sources, fmt):
            return ScoreAnswerStore(config.output.path, info.output_dim, fp, config.model)
        return LabelStore(config.output.path, fmt, info, fp, all_scores=False)

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        # NOTE: all_scores stays a key (False: score writes one value), so a run started earlier resumes
        return {"task": self.name, "all_scores": False, "pairs": list(config.input.pair_columns)}


TASK = ScoreTask()
