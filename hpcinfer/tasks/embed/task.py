"""The embed task, and what every task on the encoder pipeline shares (`EncoderTask`).

embed, classify, score and ner run the same job (read -> tokenize -> plan -> stage -> execute ->
write, job.py): they differ in the checkpoint they load, the values a row's forward pass gives and
the rows written for them. Each is an `EncoderTask` with its own claims, options and settling.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ...files.parts import PartStore
from ...files.sources import Source, is_openai_input
from ...models.checkpoint import CheckpointInfo
from ...registry import EVERY_TASK, Checkpoint, RunGiven

# What the encoder pipeline reads, for every task on it: rows, tokenizing, batching, the stages.
PIPELINE = (
    "input.input_format",
    "input.rate",
    "input.rate_seed",
    "tokenize",
    "plan",
    "pipeline",
    "embed.prompt",
    "embed.prompt_name",
)
ROW_TEXT = ("input.text_column", "input.prompt_column")  # where a plain row's text is (not an OpenAI body's)


class EncoderTask:
    """A task on the encoder pipeline; `own` are the options it reads besides the pipeline's."""

    name = ""
    own: tuple[str, ...] = ()
    endpoints: tuple[str, ...] = ()

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
            "embed.all_scores": "every label's probability is what --task classify writes",
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

    def inspect(self, path: Path, config: RunConfig) -> CheckpointInfo:
        """The checkpoint's facts for this task (`--backend transformers`: as transformers loads it)."""
        if config.backend == "transformers":
            from ...models.hf_backend import inspect_hf

            return inspect_hf(path, self.name)
        from ...models.registry import inspect_embedder

        return inspect_embedder(path, self.name)

    def store(
        self, config: RunConfig, fmt: str, info: CheckpointInfo, fp: dict[str, Any], sources: list[Source]
    ) -> PartStore:
        """Where a window's values become output rows (`openai_output` says whether to answer in OpenAI's shape)."""
        if openai_output(sources, fmt):
            from .openai_answers import OpenAIEmbeddingStore

            return OpenAIEmbeddingStore(config.output.path, info.output_dim, fp, config.model, info.pooling.normalize)
        return PartStore(config.output.path, fmt, info.output_dim, fp)

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        """Options of this task that change its output rows, besides the pipeline's (job.embed_fingerprint)."""
        return {}

    def run(self, config: RunConfig, given: RunGiven) -> Any:
        from .given import RunExtras
        from .job import run_embed

        g = given
        extras = RunExtras(g.progress, g.hooks, g.ranges, g.batch_profiler, g.model, stop=g.stop)
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


class EmbedTask(EncoderTask):
    """Sentence embeddings: a vector per row, pooled as the checkpoint's sentence-transformers files say."""

    name = "embed"
    own = (
        "embed.pooling",
        "embed.normalize",
        "embed.dimensions",
        "embed.precision",
        "embed.calibration",
        "embed.output_value",
    )
    endpoints = ("/v1/embeddings",)

    def settle(self, config: RunConfig) -> RunConfig:
        config = super().settle(config)
        if config.embed.output_value == "token_embeddings":
            from .token_embeddings import settle_token_embeddings

            return settle_token_embeddings(config)
        return config

    def inspect(self, path: Path, config: RunConfig) -> CheckpointInfo:
        """--output-value token_embeddings: the BERT encoder with its own head (token_embeddings.py)."""
        if config.embed.output_value == "token_embeddings":
            from .token_embeddings import inspect_token_embedder

            return inspect_token_embedder(path, config.tokenize.max_length)
        return super().inspect(path, config)

    def store(
        self, config: RunConfig, fmt: str, info: CheckpointInfo, fp: dict[str, Any], sources: list[Source]
    ) -> PartStore:
        """Plain embeddings in --precision (precision.py); an OpenAI batch file is answered in floats."""
        embed = config.embed
        if embed.output_value == "token_embeddings":
            from .token_embeddings import TokenEmbeddingStore

            if openai_output(sources, fmt):
                raise ConfigError("--output-value token_embeddings: an OpenAI batch file has no such endpoint")
            return TokenEmbeddingStore(config.output.path, fmt, info, fp)
        if openai_output(sources, fmt):
            if embed.precision != "float32":
                raise ConfigError(
                    f"--precision {embed.precision}: an OpenAI batch file is answered in OpenAI's float or "
                    "base64-float32 embeddings"
                )
            return super().store(config, fmt, info, fp, sources)
        from .precision import precision_store

        return precision_store(config.output.path, fmt, info.output_dim, fp, embed.precision, embed.calibration)

    def fingerprint(self, config: RunConfig) -> dict[str, Any]:
        """--precision, the --calibration file's contents and --output-value change the rows (only when set:
        older runs resume)."""
        from .precision import calibration_digest

        precision, output_value = config.embed.precision, config.embed.output_value
        return {
            "precision": None if precision == "float32" else precision,
            "calibration": calibration_digest(config.embed.calibration),
            "output_value": None if output_value == "sentence_embedding" else output_value,
        }

    def claims(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.causal_lm:
            if checkpoint.sentence_transformers:
                return "a causal LM with sentence-transformers modules: a decoder embedder"
            return None
        return "an encoder" if checkpoint.architecture else "no architecture named: an encoder"


TASK = EmbedTask()
