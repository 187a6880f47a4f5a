"""The score task: a cross-encoder (a one-label sequence classifier) scores each row's text pair.
Which two columns hold the pairs is `with_pair_columns`'s to settle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ...files.parts import PartStore
from ...files.sources import Source, expand_paths, is_batch_line, json_objects, read_schema
from ...models.checkpoint import CheckpointInfo
from ...pipeline.labels import LabelStore
from ...pipeline.task import EncoderTask, openai_output
from ...registry import Checkpoint
from .answers import ScoreAnswerStore


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


PAIR_DEFAULTS = (("query", "document"), ("text", "text_pair"))


def with_pair_columns(config: RunConfig) -> RunConfig:
    """A score run's pair columns: --pair-columns, else the first of PAIR_DEFAULTS the input has
    (its first file's columns).

    NOTE: an OpenAI batch file's bodies name their own pairs (/v1/score, /v1/rerank); its run gets
    the first defaults all the same, since set pair columns are what tells the reader a run scores.
    """
    files = expand_paths(config.input.paths)
    first = files[0] if files else ""
    objects = [] if first.lower().endswith((".parquet", ".pq")) else json_objects(first)
    if config.input.input_format == "openai" or (objects and is_batch_line(objects[0])):
        if config.input.pair_columns:
            raise ConfigError(
                "--pair-columns: an OpenAI batch file's bodies name their pairs (text_1/text_2, query/documents)"
            )
        return replace(config, input=replace(config.input, pair_columns=PAIR_DEFAULTS[0]))
    if config.input.pair_columns:
        return config
    if first.lower().endswith((".parquet", ".pq")):
        columns = set(read_schema(first).names)
    else:
        columns = {key for obj in objects for key in obj}
    for pair in PAIR_DEFAULTS:
        if set(pair) <= columns:
            return replace(config, input=replace(config.input, pair_columns=pair))
    shown = " or ".join(",".join(p) for p in PAIR_DEFAULTS)
    raise ConfigError(f"--task score reads text pairs: the input has neither {shown}; give --pair-columns A,B")
