"""The run's pooling options (the embed task's --pooling, --normalize, --dimensions; every pooling
task's --prompt, --prompt-name) applied over what the checkpoint's sentence-transformers files say,
checked once at start-up."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import EmbedConfig, RunConfig, TokenizeConfig
from ..errors import ConfigError
from ..models.checkpoint import CheckpointInfo, PoolingSpec
from ..models.registry import resolve_model_path
from ..registry import pick_task, task_named


def encoder_task(config: RunConfig) -> Any:
    """The run's task on the encoder pipeline (embed, classify, score, ner, sparse: an `EncoderTask`)."""
    task = task_named(pick_task(config))
    if not hasattr(task, "store"):
        raise ConfigError(f"--task {task.name} does not run on the encoder pipeline")
    return task


def embed_checkpoint(config: RunConfig) -> CheckpointInfo:
    """The run's checkpoint, its pooling, dimensions and prompt as the run's options set them."""
    info = encoder_task(config).inspect(resolve_model_path(config.model), config)
    return with_embed_options(info, config.embed, config.tokenize)


def with_embed_options(info: CheckpointInfo, options: EmbedConfig, tokenize: TokenizeConfig) -> CheckpointInfo:
    """`info` with the run's pooling, normalisation and dimensions (the embed task's) and its prompt
    (every pooling task's: it is tokenized with the row)."""
    mode = options.pooling or info.pooling.mode  # NOTE: --pooling's choices are its field's (config.py)
    normalize = info.pooling.normalize if options.normalize is None else options.normalize
    hidden = info.config.hidden_size
    if options.dimensions is not None and not 1 <= options.dimensions <= hidden:
        raise ConfigError(f"--dimensions {options.dimensions}: the model's embeddings have {hidden} dimensions")
    if tokenize.prompt is not None and tokenize.prompt_name is not None:
        raise ConfigError("give --prompt or --prompt-name, not both")
    prompt = info.prompt  # the checkpoint's default prompt, if it names one
    if tokenize.prompt is not None:
        prompt = tokenize.prompt
    elif tokenize.prompt_name is not None:
        if tokenize.prompt_name not in info.prompts:
            named = ", ".join(sorted(info.prompts)) or "none"
            raise ConfigError(f"--prompt-name {tokenize.prompt_name!r}: the checkpoint's prompts are {named}")
        prompt = info.prompts[tokenize.prompt_name]
    return replace(info, pooling=PoolingSpec(mode, normalize, options.dimensions), prompt=prompt)


__all__ = ["embed_checkpoint", "encoder_task", "with_embed_options"]
