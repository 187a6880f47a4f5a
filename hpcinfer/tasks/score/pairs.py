"""Which two columns hold a score run's text pairs."""

from __future__ import annotations

from dataclasses import replace

from ...config import RunConfig
from ...errors import ConfigError
from ...files.sources import expand_paths, is_batch_line, json_objects, read_schema

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


__all__ = ["PAIR_DEFAULTS", "with_pair_columns"]
