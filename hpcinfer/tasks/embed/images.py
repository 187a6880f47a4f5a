"""--image-column: an embedding run over images (a CLIP or SigLIP model): what it refuses, and its
smaller read blocks and windows (a row is an image's pixels, ~150 kB, not a few hundred bytes of text)."""

from __future__ import annotations

from dataclasses import replace

from ...config import InputConfig, PlanConfig, RunConfig
from ...errors import ConfigError

IMAGE_BLOCK_ROWS = 64  # images read, then decoded, together (the decode threads share a block)
# images per committed window: their pixels wait here until batched. All are one length, so a
# window sorts nothing; a smaller one lets compute start sooner (a window's batches begin only once
# its rows are decoded: 1,024 images kept two CPU cores waiting ~4 s), holds less (256 x ~150 kB)
# and loses less to a kill. 1,000 images, 2 cores, runs interleaved: 66.5 and 75.2 s at 1,024,
# 61.1 and 68.8 s at 256 (benchmarks/speed/bench_images.py's pictures).
IMAGE_WINDOW_ROWS = 256


def settle_images(config: RunConfig) -> RunConfig:
    """The run's config for images; options that do not apply to them refused in one line."""
    refused = {
        "--output-value token_embeddings": config.embed.output_value == "token_embeddings",
        "--quantize": config.device.quantize not in ("none", "auto"),
        "--cuda-graphs": config.device.cuda_graphs,
        "--prompt / --prompt-name / --prompt-column": bool(
            config.tokenize.prompt or config.tokenize.prompt_name or config.input.prompt_column
        ),
        "--max-length": config.tokenize.max_length is not None,
        "--backend transformers": config.backend == "transformers",
        "--tp": config.device.tensor_parallel > 1,
        "--pair-columns": bool(config.input.pair_columns),
        "an OpenAI batch input": config.input.input_format == "openai",
    }
    named = [name for name, given in refused.items() if given]
    if named:
        raise ConfigError(f"--image-column: {named[0]} does not apply to images")
    inputs, plan = config.input, config.plan
    if inputs.read_block_rows == InputConfig().read_block_rows:
        inputs = replace(inputs, read_block_rows=IMAGE_BLOCK_ROWS)
    if plan.sort_window == PlanConfig().sort_window:
        plan = replace(plan, sort_window=IMAGE_WINDOW_ROWS)
    device = replace(config.device, quantize="none")  # NOTE: auto: images run in float
    return replace(config, input=inputs, plan=plan, device=device)
