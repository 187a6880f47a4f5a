"""The library entry point: `run(RunConfig) -> report`. The CLI is a thin shell over this.

`run` picks the task (embed, or generate for a causal LM) and where it runs (this machine, or a Ray
cluster), and hands the config to that task's job. Nothing below this module imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .config import RunConfig
from .device import Device
from .errors import ConfigError, Interrupted
from .models.registry import LoadedModel
from .obs.profile import RangeBackend
from .obs.progress import Progress
from .tasks import cluster_task, pick_task
from .tasks.embed.options import with_pair_columns
from .tasks.embed.report import RunReport

__all__ = ["Interrupted", "run"]


def run(
    config: RunConfig,
    *,
    device: Device | None = None,
    devices: list[Device] | None = None,
    progress: Progress | None = None,
    hooks: dict[str, Callable[[Any], None]] | None = None,
    ranges: RangeBackend | None = None,
    batch_profiler: Any = None,
    model: LoadedModel | None = None,
) -> RunReport:
    """Runs the job: one output row per valid input row, in input order; rejects to OUTPUT.rejects.jsonl.

    `device` overrides `config.device.device`, and `devices` (one replica each) `config.device.devices`:
    tests pass simulated or fault-injecting devices. `hooks` maps a stage name to a callable run before
    each item of that stage (fault injection in tests). `model`, already loaded for the (first) device
    and dtype, saves loading it again (tune's trials share one). `ranges` gets a range per work item
    (hpcinfer profile), `batch_profiler` drives torch.profiler over a few embedding batches.
    """
    config.validate()
    task = pick_task(config)
    config = with_pair_columns(replace(config, task=task))  # --task score: which columns hold the pairs
    if task == "generate" and config.backend != "native":  # static batches: what it cannot do is refused here
        from .engine.hf_engine import refused_options

        refused_options(config)
    if config.device.tensor_parallel > 1 and task not in ("generate", "embed"):
        raise ConfigError(f"--tp splits a decoder (generation, decoder embedders); --task {task} runs an encoder")
    affinity = config.device.cpu_affinity.strip()
    if affinity != "off" and config.device.tensor_parallel > 1:
        raise ConfigError("--cpu-affinity pins the threads of one process; not with --tp (a process per rank) yet")
    if affinity not in ("off", "auto") and config.cluster.engine == "ray":
        raise ConfigError(
            "--engine ray takes --cpu-affinity auto (each replica on the cores nearest its GPUs) or off; "
            "a core list names one machine's cores"
        )
    if config.cluster.engine == "ray":  # NOTE: Ray is imported only when it runs
        from .ray_engine.driver import run_on_ray

        return run_on_ray(config, cluster_task(task), progress=progress)
    if task == "generate":
        if batch_profiler is not None:
            raise ConfigError("--torch-profile records embedding batches; profile generation with nsys")
        from .tasks.generate.job import run_generate

        return run_generate(config, progress=progress, ranges=ranges)  # type: ignore[return-value]
    from .tasks.embed.given import RunExtras
    from .tasks.embed.job import run_embed

    return run_embed(config, RunExtras(progress, hooks, ranges, batch_profiler, model), device=device, devices=devices)
