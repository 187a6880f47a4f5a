"""The run's embedding options (--pooling, --normalize, --dimensions, --prompt, --prompt-name)
applied over what the checkpoint's sentence-transformers files say, checked once at start-up."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import EmbedConfig, RunConfig
from ..errors import ConfigError
from ..models.checkpoint import POOLING_MODES, CheckpointInfo, PoolingSpec
from ..models.registry import resolve_model_path
from ..registry import pick_task, task_named


def encoder_task(config: RunConfig) -> Any:
    """The run's task on the encoder pipeline (embed, classify, score, ner: an `EncoderTask`)."""
    task = task_named(pick_task(config))
    if not hasattr(task, "store"):
        raise ConfigError(f"--task {task.name} does not run on the encoder pipeline")
    return task


def embed_checkpoint(config: RunConfig) -> CheckpointInfo:
    """The run's checkpoint, its pooling, dimensions and prompt as the run's options set them."""
    return with_embed_options(encoder_task(config).inspect(resolve_model_path(config.model), config), config.embed)


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


__all__ = ["embed_checkpoint", "encoder_task", "with_embed_options"]
