"""The generate task: a causal LM's answers, by continuous batching over a paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...config import RunConfig
from ...engine.hf_engine import WHAT_IS_LOST
from ...errors import ConfigError
from ...registry import EVERY_TASK, Checkpoint, RunGiven

_ROWS = "its rows give prompt, messages or prompt_token_ids (an OpenAI batch line: its body)"


class GenerateTask:
    name = "generate"
    endpoints = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

    def claims(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.causal_lm and not checkpoint.sentence_transformers:
            return "a causal LM"
        return None

    def honours(self, config: RunConfig) -> Iterable[str]:
        return (*EVERY_TASK, "input.rate", "input.rate_seed", "generate")

    def hints(self) -> dict[str, str]:
        return {
            "input.text_column": _ROWS,
            "input.prompt_column": _ROWS,
            "input.input_format": "generation tells the format by the suffix (.jsonl, .parquet) and OpenAI batch "
            "lines by their custom_id and body",
            "tokenize.max_length": "--max-model-len caps the context",
            "plan.sort_window": "--window-rows sizes a committed window",
            "plan.max_batch_tokens": "--max-num-batched-tokens is a step's token budget",
            "plan.max_batch_size": "--max-num-seqs bounds the sequences in flight",
            "pipeline.overlap": "the engine's step loop has no serial twin",
            "pipeline.queue_depth": "the engine's admission bounds what is queued (--max-num-seqs)",
            "embed": "pooling, prompts and labels are the encoder tasks' (embed, classify, score, ner, sparse)",
            "input.pair_columns": "pairs are what --task score reads (a cross-encoder)",
        }

    def settle(self, config: RunConfig) -> RunConfig:
        if config.backend == "transformers":  # static batches: what it cannot do is refused here
            transformers_refusals(config)
        if config.generate.loras and config.cluster.engine == "ray" and config.device.tensor_parallel > 1:
            raise ConfigError("--lora with --tp is not served yet (on Ray or locally)")
        return config

    def native_problem(self, config: RunConfig) -> str | None:
        """Why the native decoder cannot generate from the checkpoint (registry.settle_backend)."""
        from ...errors import HpcinferError, UnsupportedModel
        from ...models.decoder_inspect import inspect_decoder
        from ...models.registry import resolve_model_path

        try:
            inspect_decoder(resolve_model_path(config.model), native=True)
        except UnsupportedModel as exc:
            return exc.reason.split(" (")[0]
        except HpcinferError:  # NOTE: any other problem is the native run's to report, in its own order
            return None
        return None

    def run(self, config: RunConfig, given: RunGiven) -> Any:
        if given.batch_profiler is not None:
            raise ConfigError("--torch-profile records embedding batches; profile generation with nsys")
        from .job import run_generate

        return run_generate(config, progress=given.progress, ranges=given.ranges, stop=given.stop, shelf=given.shelf)

    def cluster(self) -> Any:
        from .cluster import GenerateCluster

        return GenerateCluster()

    def tuning(self) -> Any:
        from .tuning import GenerateTuning

        return GenerateTuning()


def transformers_refusals(config: RunConfig) -> None:
    """A run option the transformers engine cannot honour: a one-line error naming it and why."""
    g, d = config.generate, config.device
    wants = {
        "--engine ray": config.cluster.engine == "ray",
        "--devices": bool(d.devices),
        "--tp": getattr(d, "tensor_parallel", 1) > 1,
        "--cuda-graphs": d.cuda_graphs,
        "--quantize": d.quantize != "none",
        "--kv-cache-memory": g.kv_cache_memory is not None,
        "--kv-cache-dtype": g.kv_cache_dtype != "auto",
        "--attention": g.attention != "auto",
        "--json-schema / --regex / --choice / --grammar (structured output)": bool(
            g.json_schema or g.regex or g.choice or g.grammar
        ),
        "--n": g.n != 1,
        "--repetition-penalty / --presence-penalty / --frequency-penalty / --min-tokens": (
            g.repetition_penalty,
            g.presence_penalty,
            g.frequency_penalty,
            g.min_tokens,
        )
        != (1.0, 0.0, 0.0, 0),
    }
    for flag, asked in wants.items():
        if asked:
            raise ConfigError(f"{flag} needs hpcinfer's own engine; --backend transformers generates in {WHAT_IS_LOST}")


TASK = GenerateTask()
