"""The tasks a run can do, one folder each: `embed/` (sentence embeddings) and `generate/` (a causal LM's answers).

A task folder holds everything that is the task's own: how a row is parsed, its engine, its output
rows, the options in its resume fingerprint, its report, its Ray replica and cluster commit. What
every task shares lives outside: job/ (claiming the output, windows, accounting, signals), files/,
place/, obs/, ray_engine/ (the driver), tune/. This module is the registry: `pick_task` decides
which task a run is, and the functions below hand out a task's parts by name, so the shared code
knows tasks only through them. Adding a task is a folder and a line in each.
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig

TASKS = ("embed", "generate")


def pick_task(config: RunConfig) -> str:
    """The run's task: `--task`, or for `auto` what the checkpoint is (see `auto_task`)."""
    return config.task if config.task != "auto" else auto_task(config)[0]


def auto_task(config: RunConfig) -> tuple[str, str]:
    """(task, why) for `--task auto`: a `*ForCausalLM` generates, unless it carries
    sentence-transformers modules (an embedder such as Qwen3-Embedding); a
    `*ForSequenceClassification` with one label scores pairs (a cross-encoder), with more classifies;
    anything else embeds."""
    from ..models.checkpoint import read_model_json
    from ..models.decoder_checkpoint import is_causal_lm
    from ..models.registry import resolve_model_path

    path = resolve_model_path(config.model)
    if is_causal_lm(path):
        if (path / "modules.json").is_file():
            return "embed", "a causal LM with sentence-transformers modules: a decoder embedder"
        return "generate", "a causal LM"
    raw = read_model_json(path / "config.json") if (path / "config.json").is_file() else {}
    arch = str(next(iter(raw.get("architectures") or []), "")) if isinstance(raw, dict) else ""
    if arch.endswith("ForSequenceClassification"):
        labels = len(raw.get("id2label") or {}) or int(raw.get("num_labels", 2))
        if labels == 1:
            return "score", f"a {arch} with one label: a cross-encoder"
        return "classify", f"a {arch} with {labels} labels"
    return "embed", "an encoder" if arch else "no architecture named: an encoder"


def cluster_task(task: str) -> Any:
    """The task's side of a Ray run (a `ray_engine.driver.ClusterTask`)."""
    if task == "generate":
        from .generate.cluster import GenerateCluster

        return GenerateCluster()
    from .embed.cluster import EmbedCluster

    return EmbedCluster()


def replica_class(task: str) -> type:
    """The class a Ray actor builds to run the task's engine on its windows (imported only there)."""
    if task == "generate":
        from .generate.replica import GenerateReplica

        return GenerateReplica
    from .embed.replica import EmbedReplica

    return EmbedReplica


def tuning_task(task: str) -> Any:
    """The task's side of `hpcinfer tune` (a `tune.command.TuneTask`)."""
    if task == "generate":
        from .generate.tuning import GenerateTuning

        return GenerateTuning()
    from .embed.tuning import EmbedTuning

    return EmbedTuning()
