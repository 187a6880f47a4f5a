"""The task registry: one line per task, and the `Task` protocol every task folder implements.

A task (each key of `TASKS` below) is a folder under tasks/ whose `task.py` holds one
object implementing `Task`: which checkpoints it claims under `--task auto`, which options it
honours (the others are refused in one line, never silently ignored), what it settles before the
run, its local run, and its Ray and tune parts. `api.run`, `tune` and the Ray actor know tasks only
through this module, which names each by its import path: nothing here imports a task folder until
a run asks for it, so shared code never imports tasks/ and the folders form no cycle.

Adding a task is a folder and a line in `TASKS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from .config import RunConfig, flatten
from .errors import ConfigError
from .obs.report_json import JsonReport

# NOTE: the order is `--task auto`'s: the first task that claims a checkpoint runs it; embed,
# last, claims whatever is left (an encoder).
TASKS: dict[str, str] = {
    "generate": "hpcinfer.tasks.generate.task:TASK",
    "score": "hpcinfer.tasks.score.task:TASK",
    "classify": "hpcinfer.tasks.classify.task:TASK",
    "ner": "hpcinfer.tasks.ner.task:TASK",
    "sparse": "hpcinfer.tasks.sparse.task:TASK",
    "embed": "hpcinfer.tasks.embed.task:TASK",
}

# Options every task honours: where rows come from and go, the model, devices, the cluster, reports.
EVERY_TASK = (
    "input.paths",
    "input.id_column",
    "input.image_files",  # NOTE: serve sets it for every job; a task that reads no image ignores it
    "input.limit",
    "input.read_block_rows",
    "input.read_chunk_bytes",
    "model",
    "task",
    "backend",
    "output",
    "report_path",
    "report_html",
    "metrics_port",
    "metrics_linger_s",
    "trace_path",
    "storage_options",
    "pipeline.progress",
    "device",
    "cluster",
)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What `--task auto` reads of a checkpoint to pick its task."""

    path: Path
    architecture: str  # config.json's first `architectures` entry; "" when it names none
    raw: dict[str, Any]  # config.json
    causal_lm: bool  # a *ForCausalLM (or a GGUF file)
    sentence_transformers: bool  # it carries sentence-transformers modules (modules.json)

    @property
    def label_count(self) -> int:
        """A classifier's labels, as transformers counts them (id2label, else num_labels, else 2)."""
        return len(self.raw.get("id2label") or {}) or int(self.raw.get("num_labels", 2))


@dataclass(frozen=True, slots=True)
class RunGiven:
    """What a caller of `api.run` hands a run besides its config (tests, profile, tune)."""

    device: Any = None  # one device overriding --device (a simulated or fault-injecting one in tests)
    devices: Any = None  # several, one replica each
    progress: Any = None
    hooks: dict[str, Callable[[Any], None]] | None = None  # stage name -> called before each item
    ranges: Any = None  # a profiler range per work item (hpcinfer profile)
    batch_profiler: Any = None  # torch.profiler over a few batches
    model: Any = None  # a LoadedModel already loaded for the (first) device and dtype
    stop: Any = None  # a threading.Event: set, the run stops between work items as on Ctrl-C (Interrupted)
    shelf: Any = None  # a models.shelf.ModelShelf: models kept loaded between runs (hpcinfer serve)


class Task(Protocol):
    """One task: a folder under tasks/ and a line in `TASKS`."""

    name: str
    endpoints: tuple[str, ...]  # the OpenAI batch endpoints it answers (`hpcinfer serve` accepts these)

    def claims(self, checkpoint: Checkpoint) -> str | None:
        """Why `--task auto` runs this checkpoint as this task, or None when it does not."""

    def honours(self, config: RunConfig) -> Iterable[str]:
        """The config fields (or whole sections: `plan`) the task reads for this config's input."""

    def hints(self) -> dict[str, str]:
        """Field (or section) -> what to use instead, for the options it refuses."""

    def settle(self, config: RunConfig) -> RunConfig:
        """What the task decides before a run on any engine: checks and the values it fills in."""

    def run(self, config: RunConfig, given: RunGiven) -> JsonReport:
        """The run on this machine; returns the task's report."""

    def native_problem(self, config: RunConfig) -> str | None:
        """Why hpcinfer's own model cannot run the checkpoint for this task (None when it can, or
        when the task has no transformers path to fall back on: its native refusal is the answer)."""

    def cluster(self) -> Any:
        """Its side of a Ray run (a `ray_engine.driver.ClusterTask`)."""

    def tuning(self) -> Any:
        """Its side of `hpcinfer tune` (a `tune.command.TuneTask`)."""


def task_named(name: str) -> Task:
    """The registered task called `name` (its module imported now, not before)."""
    if name not in TASKS:
        raise ConfigError(f"--task must be one of auto, {', '.join(sorted(TASKS))} (got {name!r})")
    return load_object(TASKS[name])


def load_object(path: str) -> Any:
    """'package.module:NAME' -> that object."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def read_checkpoint(config: RunConfig) -> Checkpoint:
    from .models.checkpoint import read_model_json
    from .models.decoder_inspect import is_causal_lm
    from .models.registry import resolve_model_path

    path = resolve_model_path(config.model)
    raw = read_model_json(path / "config.json") if (path / "config.json").is_file() else {}
    raw = raw if isinstance(raw, dict) else {}
    arch = str(next(iter(raw.get("architectures") or []), ""))
    return Checkpoint(path, arch, raw, is_causal_lm(path), (path / "modules.json").is_file())


def auto_task(config: RunConfig) -> tuple[str, str]:
    """(task, why) for `--task auto`: the first registered task that claims the checkpoint."""
    checkpoint = read_checkpoint(config)
    for name in TASKS:
        why = task_named(name).claims(checkpoint)
        if why is not None:
            return name, why
    raise AssertionError("embed claims every checkpoint")


def pick_task(config: RunConfig) -> str:
    """The run's task: `--task`, or for `auto` what the checkpoint is (see `auto_task`)."""
    return config.task if config.task != "auto" else auto_task(config)[0]


# What a run on the transformers path gives up, said when `--backend auto` takes it
FALLBACK_COST = (
    "transformers' own forward: no int8, token embeddings, NER or SPLADE; "
    "no fused QKV or prepacked CPU linears, worth 2-7% on base-size encoders (docs/models.md)"
)


def settle_backend(task: Task, config: RunConfig) -> tuple[RunConfig, str]:
    """The run's config with `--backend auto` made native or transformers for this checkpoint and
    task, and the one line that says so when it is not native ("" otherwise, and for a backend given)."""
    if config.backend != "auto":
        return config, ""
    native_problem = getattr(task, "native_problem", None)  # NOTE: a task without one runs natively
    problem = native_problem(config) if native_problem is not None else None
    if problem is None:
        return replace(config, backend="native"), ""
    line = f"hpcinfer: {problem}: running on --backend transformers ({FALLBACK_COST})"
    return replace(config, backend="transformers"), line


class IgnoredOptions(ConfigError):
    """Options set that the run's task would not read: refused rather than silently ignored."""

    def __init__(self, task: str, fields: list[tuple[str, Any]], hint: str | None) -> None:
        self.task, self.fields, self.hint = task, fields, hint
        super().__init__(self.message(lambda field, value: "--" + field.rsplit(".", 1)[-1].replace("_", "-")))

    def message(self, flag: Callable[[str, Any], str]) -> str:
        """One line naming the options by `flag(field, value)` (the command line's spelling)."""
        named = ", ".join(flag(field, value) for field, value in self.fields)
        verb = "does not read" if len(self.fields) == 1 else "reads none of"
        return f"--task {self.task} {verb} {named}" + (f": {self.hint}" if self.hint else "")


_DEFAULTS = flatten(RunConfig())


def check_honoured(task: Task, config: RunConfig) -> None:
    """Refuses, in one line, every option set away from its default that `task` does not read."""
    honoured = tuple(task.honours(config))
    ignored = [
        (field, value)
        for field, value in flatten(config).items()
        if value != _DEFAULTS[field] and not any(field == h or field.startswith(h + ".") for h in honoured)
    ]
    if ignored:
        hints = task.hints()
        named = [hints.get(field) or hints.get(field.split(".")[0]) for field, _ in ignored]  # field, or section
        hint = next((h for h in named if h), None)
        raise IgnoredOptions(task.name, ignored, hint)


__all__ = [
    "EVERY_TASK",
    "TASKS",
    "Checkpoint",
    "IgnoredOptions",
    "RunGiven",
    "Task",
    "auto_task",
    "check_honoured",
    "load_object",
    "pick_task",
    "read_checkpoint",
    "settle_backend",
    "task_named",
]
