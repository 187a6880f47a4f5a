"""What a generation run refuses before any work, each in one line: the combinations of options
and models the engine does not run (yet), checked once its model and devices are known."""

from __future__ import annotations

from typing import Any

import torch

from ...config import RunConfig
from ...errors import ConfigError


def refuse_what_cannot_run(config: RunConfig, info: Any, device: torch.device, loras: list[Any]) -> None:
    """`info`: the model's DecoderInfo; `device`: the first engine's; `loras`: --lora's adapters."""
    tp, quantized, fallback = (
        config.device.tensor_parallel > 1,
        config.device.quantize != "none",
        config.backend == "transformers",
    )
    if config.device.cuda_graphs and any(getattr(info.config, "moe_layers", ())):
        raise ConfigError("--cuda-graphs with a mixture of experts is not built yet: its routing reads each "
                          "step's expert counts on the host, which a captured decode cannot")  # fmt: skip
    if config.device.cuda_graphs and device.type != "cuda":
        raise ConfigError(f"--cuda-graphs needs a CUDA device; generation runs on {device} here")
    if loras and (tp or quantized or fallback):
        raise ConfigError("--lora runs on the native engine's float weights: not with --tp, --quantize or "
                          "--backend transformers yet")  # fmt: skip
    if config.generate.max_loras and not loras:
        raise ConfigError("--max-loras bounds --lora's adapters: give them with --lora NAME=PATH")
    if info.vision is not None and (tp or quantized):
        raise ConfigError("a vision-language model runs on one device in float weights: not --tp, --quantize")
    if config.generate.speculative != "none" and (tp or fallback):
        raise ConfigError("--speculative runs in the native engine on one device: not with --tp or "
                          "--backend transformers yet")  # fmt: skip


__all__ = ["refuse_what_cannot_run"]
