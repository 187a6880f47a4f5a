"""What every task on the encoder pipeline is (`EncoderTask`): embed, classify, score, ner and
sparse run the same job (read -> tokenize -> plan -> stage -> execute -> write, job.py); they
differ in the checkpoint they load, the values a row's forward pass gives and the rows written for
them. Each task folder subclasses `EncoderTask` with its own claims, options and settling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import PlanConfig, RunConfig
from ..errors import ConfigError, HpcinferError, UnsupportedModel
from ..files.parts import PartStore
from ..files.sources import Source, is_openai_input
from ..models.checkpoint import CheckpointInfo
from ..registry import EVERY_TASK, Checkpoint, RunGiven

# What the encoder pipeline reads, for every task on it: rows, tokenizing, batching, the stages.
PIPELINE = (
    "input.input_format",
    "input.rate",
    "input.rate_seed",
    "tokenize",
    "plan",
    "pipeline",
)
ROW_TEXT = ("input.text_column", "input.prompt_column")  # where a plain row's text is (not an OpenAI body's)

# NOTE: the writer holds a window's values until its commit; a head whose rows can hold many items
# (token states, vocabulary entries) has its default window cut so that, at worst, they fit this
WINDOW_BYTES = 1 << 30


class EncoderTask:
    """A task on the encoder pipeline; `own` are the options it reads besides the pipeline's."""

    name = ""
    own: tuple[str, ...] = ()
    endpoints: tuple[str, ...] = ()
    transformers_path = True  # `--backend auto` falls back to transformers where the native models cannot run it

    def claims(self, checkpoint: Checkpoint) -> str | None:
        return None

    def honours(self, config: RunConfig) -> Iterable[str]:
        text = () if is_openai_input(config.input) else ROW_TEXT
        return (*EVERY_TASK, *PIPELINE, *text, *self.own)

    def hints(self) -> dict[str, str]:
        return {
            "input.text_column": "an OpenAI batch file's bodies hold their own input",
            "input.prompt_column": "an OpenAI batch file's bodies hold their own input",
            "input.pair_columns": "pairs are what --task score reads (a cross-encoder)",
            "input.image_column": "images are embedded by --task embed (a CLIP or SigLIP model)",
            "classify": "every label's probability is what --task classify writes",
            "sparse": "a row's largest vocabulary entries are what --task sparse writes",
            "embed": "pooling, dimensions and precision are the embeddings' (--task embed)",
            "generate": "sampling and the KV cache are generation's (a causal LM, --task generate)",
        }

    def settle(self, config: RunConfig) -> RunConfig:
        if config.device.quantize == "fp8":
            raise ConfigError("--quantize fp8 applies to causal LMs (generation); pooling tasks take int8 or auto")
        if config.device.tensor_parallel > 1 and self.name != "embed":
            raise ConfigError(
                f"--tp splits a decoder (generation, decoder embedders); --task {self.name} runs an encoder"
            )
        return config

    def native_problem(self, config: RunConfig) -> str | None:
        """Why the native models cannot run the checkpoint for this task (registry.settle_backend):
        the reason hpcinfer has no native model for it; None where they can, or where the task has
        no transformers path (`transformers_path` False: the native refusal is the answer)."""
        if not self.transformers_path:
            return None
        from ..models.registry import resolve_model_path

        try:
            self.inspect(resolve_model_path(config.model), replace(config, backend="native"))
        except UnsupportedModel as exc:
            return exc.reason.split(" (")[0]
        except HpcinferError:  # NOTE: any other problem is the native run's to report, in its own order
            return None
        return None

    def inspect(self, path: Path, config: RunConfig) -> CheckpointInfo:
        """The checkpoint's facts for this task (`--backend transformers`: as transformers loads it)."""
        if config.backend == "transformers":
            from ..models.hf_backend import inspect_hf

            return inspect_hf(path, self.name)
        from ..models.registry import inspect_embedder

        return inspect_embedder(path, self.name, images=config.input.image_column is not None)

    def store(
        self, config: RunConfig, fmt: str, info: CheckpointInfo, fp: dict[str, Any], sources: list[Source]
    ) -> PartStore:
        """Where a window's values become output rows: plain rows here; a task that answers OpenAI
        batch files (`openai_output`) returns its own store for them."""
        if openai_output(sources, fmt):
            raise ConfigError(f"an OpenAI batch file has no endpoint that --task {self.name} answers")
        return PartStore(config.output.path, fmt, info.output_dim, fp)

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        """Options of this task that change its output rows, besides the pipeline's (job.embed_fingerprint)."""
        return {}

    def run(self, config: RunConfig, given: RunGiven) -> Any:
        from .given import RunExtras
        from .job import run_embed

        g = given
        extras = RunExtras(g.progress, g.hooks, g.ranges, g.batch_profiler, g.model, stop=g.stop, shelf=g.shelf)
        return run_embed(config, extras, device=given.device, devices=given.devices)

    def cluster(self) -> Any:
        from .cluster import EmbedCluster

        return EmbedCluster()

    def tuning(self) -> Any:
        from .tuning import EmbedTuning

        return EmbedTuning()


def openai_output(sources: list[Source], fmt: str) -> bool:
    """Whether the run answers an OpenAI batch file (all its inputs are one; in JSONL)."""
    openai = [s.fmt == "openai" for s in sources]
    if not any(openai):
        return False
    if not all(openai):
        raise ConfigError("an OpenAI batch file and other inputs in one run: their answers have other shapes")
    if fmt != "jsonl":
        raise ConfigError("an OpenAI batch input is answered in JSONL: give a .jsonl output")
    return True


def window_cut(config: RunConfig, info: CheckpointInfo) -> RunConfig:
    """The run's config with a default --sort-window cut so that a window of rows at their most
    items (`info.ragged.row_bytes`) holds at most WINDOW_BYTES; a sort window given is kept."""
    if info.ragged is None or config.plan.sort_window != PlanConfig().sort_window:
        return config
    rows = max(1, WINDOW_BYTES // max(1, info.ragged.row_bytes))
    if rows >= config.plan.sort_window:
        return config
    return replace(config, plan=replace(config.plan, sort_window=rows))


__all__ = ["PIPELINE", "ROW_TEXT", "WINDOW_BYTES", "EncoderTask", "openai_output", "window_cut"]
