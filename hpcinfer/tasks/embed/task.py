"""The embed task: a vector per row (sentence embeddings, a decoder embedder's, token embeddings),
pooled as the checkpoint's sentence-transformers files say, written in --precision or answered as
OpenAI `/v1/embeddings` requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ...files.parts import PartStore
from ...files.sources import Source
from ...models.checkpoint import CheckpointInfo
from ...pipeline.task import EncoderTask, openai_output
from ...registry import Checkpoint


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
        "input.image_column",
    )
    endpoints = ("/v1/embeddings",)

    def settle(self, config: RunConfig) -> RunConfig:
        config = super().settle(config)
        if config.input.image_column is not None:
            from .images import settle_images

            return settle_images(config)
        if config.embed.output_value == "token_embeddings":
            from .token_embeddings import settle_token_embeddings

            return settle_token_embeddings(config)
        return config

    def native_problem(self, config: RunConfig) -> str | None:
        """Token embeddings run only natively (their refusal is the answer); sentence embeddings fall back."""
        if config.embed.output_value == "token_embeddings":
            return None
        return super().native_problem(config)

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
            from .openai_answers import OpenAIEmbeddingStore

            return OpenAIEmbeddingStore(config.output.path, info.output_dim, fp, config.model, info.pooling.normalize)
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
            "outputs": "ragged" if output_value == "token_embeddings" else None,
        }

    def claims(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.causal_lm:
            if checkpoint.sentence_transformers:
                return "a causal LM with sentence-transformers modules: a decoder embedder"
            return None
        return "an encoder" if checkpoint.architecture else "no architecture named: an encoder"


TASK = EmbedTask()
