"""The tasks a run can do, one folder each: `embed/` (sentence embeddings) and `generate/` (a causal LM's answers).

`pick_task` is the one place that decides which task a run is: `--task`, or else the checkpoint
(a `*ForCausalLM` generates, anything else embeds).
"""

from __future__ import annotations

from ..config import RunConfig

TASKS = ("embed", "generate")


def pick_task(config: RunConfig) -> str:
    """The run's task: `--task`, or for `auto` what the checkpoint is."""
    if config.task != "auto":
        return config.task
    from ..models.decoder_checkpoint import is_causal_lm
    from ..models.registry import resolve_model_path

    return "generate" if is_causal_lm(resolve_model_path(config.model)) else "embed"
