"""The run's embedding options (--pooling, --normalize, --dimensions, --prompt, --prompt-name)
applied over what the checkpoint's sentence-transformers files say, checked once at start-up."""

from __future__ import annotations

from dataclasses import replace

import pyarrow.parquet as pq

from ...config import EmbedConfig, RunConfig
from ...errors import ConfigError
from ...files.sources import expand_paths, is_batch_line, json_objects
from ...models.checkpoint import POOLING_MODES, CheckpointInfo, PoolingSpec
from ...models.registry import inspect_embedder, resolve_model_path


def embed_checkpoint(config: RunConfig) -> CheckpointInfo:
    """The run's checkpoint, its pooling, dimensions and prompt as the run's options set them."""
    task = config.task if config.task in ("classify", "score") else "embed"
    path = resolve_model_path(config.model)
    if config.backend == "transformers":
        from ...models.hf_backend import inspect_hf

        return with_embed_options(inspect_hf(path, task), config.embed)
    return with_embed_options(inspect_embedder(path, task), config.embed)


def with_embed_options(info: CheckpointInfo, options: EmbedConfig) -> CheckpointInfo:
    mode = options.pooling or info.pooling.mode
    if mode not in POOLING_MODES:
        raise ConfigError(f"--pooling must be one of {', '.join(POOLING_MODES)} (got {mode!r})")
    normalize = info.pooling.normalize if options.normalize is None else options.normalize
    hidden = info.config.hidden_size
    if options.dimensions is not None and not 1 <= options.dimensions <= hidden:
        raise ConfigError(f"--dimensions {options.dimensions}: the model's embeddings have {hidden} dimensions")
    if options.prompt is not None and options.prompt_name is not None:
        raise ConfigError("give --prompt or --prompt-name, not both")
    prompt = info.prompt  # the checkpoint's default prompt, if it names one
    if options.prompt is not None:
        prompt = options.prompt
    elif options.prompt_name is not None:
        if options.prompt_name not in info.prompts:
            named = ", ".join(sorted(info.prompts)) or "none"
            raise ConfigError(f"--prompt-name {options.prompt_name!r}: the checkpoint's prompts are {named}")
        prompt = info.prompts[options.prompt_name]
    return replace(info, pooling=PoolingSpec(mode, normalize, options.dimensions), prompt=prompt)


PAIR_DEFAULTS = (("query", "document"), ("text", "text_pair"))


def with_pair_columns(config: RunConfig) -> RunConfig:
    """A score run's pair columns: --pair-columns, else the first of PAIR_DEFAULTS the input has
    (its first file's columns); --pair-columns on any other task is refused.

    NOTE: an OpenAI batch file's bodies name their own pairs (/v1/score, /v1/rerank); its run gets
    the first defaults all the same, since set pair columns are what tells the reader a run scores.
    """
    if config.task != "score":
        if config.input.pair_columns:
            raise ConfigError("--pair-columns is for --task score (a cross-encoder scores text pairs)")
        return config
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
        columns = set(pq.read_schema(first).names)
    else:
        columns = {key for obj in objects for key in obj}
    for pair in PAIR_DEFAULTS:
        if set(pair) <= columns:
            return replace(config, input=replace(config.input, pair_columns=pair))
    shown = " or ".join(",".join(p) for p in PAIR_DEFAULTS)
    raise ConfigError(f"--task score reads text pairs: the input has neither {shown}; give --pair-columns A,B")


__all__ = ["embed_checkpoint", "with_embed_options", "with_pair_columns"]
