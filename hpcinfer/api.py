"""The library entry point: `run(RunConfig) -> report`. The CLI is a thin shell over this.

`run` picks the task (registry.py: `--task`, or what the checkpoint is) and the backend (`auto`:
native where hpcinfer has the architecture), refuses the options that task would not read, lets it
settle the config, and runs it here or on a Ray cluster. It knows no
task by name. Nothing below this module imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .config import RunConfig
from .device import Device
from .device.machine import machine_facts
from .errors import ConfigError, Interrupted
from .files import storage
from .files.scratch import sweep_once
from .models.registry import LoadedModel
from .models.shelf import ModelShelf
from .obs.observed import Observed, ReportFiles
from .obs.profile import RangeBackend
from .obs.progress import Progress
from .obs.report_json import JsonReport
from .registry import RunGiven, check_honoured, pick_task, settle_backend, task_named

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
    stop: threading.Event | None = None,
    shelf: ModelShelf | None = None,
) -> JsonReport:
    """Runs the job: one output row per valid input row, in input order; rejects to OUTPUT.rejects.jsonl.
    Returns the task's own report (embed's `RunReport`, generate's `GenerateReport`, ...).

    `device` overrides `config.device.device`, and `devices` (one replica each) `config.device.devices`:
    tests pass simulated or fault-injecting devices. `hooks` maps a stage name to a callable run before
    each item of that stage (fault injection in tests). `model`, already loaded for the (first) device
    and dtype, saves loading it again (tune's trials share one). `ranges` gets a range per work item
    (hpcinfer profile), `batch_profiler` drives torch.profiler over a few embedding batches. Setting
    `stop` (from another thread) ends the run between work items as Ctrl-C does: what is committed
    stays, `Interrupted` is raised, and the same run with --resume finishes it. `shelf` keeps the
    models a run loads for the next run of the process to find (hpcinfer serve's batches).
    """
    config.validate()
    storage.configure(config.storage())  # NOTE: before any input is opened or output looked at
    sweep_once()  # what runs killed earlier left in $TMPDIR (files/scratch.py)
    config = replace(config, output=replace(config.output, path=storage.local_path(config.output.path)))
    task = task_named(pick_task(config))
    config, fallback = settle_backend(task, replace(config, task=task.name))  # NOTE: before the task settles
    affinity = config.device.cpu_affinity.strip()
    if affinity != "off" and config.device.tensor_parallel > 1:
        raise ConfigError("--cpu-affinity pins the threads of one process; not with --tp (a process per rank) yet")
    if affinity not in ("off", "auto") and config.cluster.engine == "ray":
        raise ConfigError(
            "--engine ray takes --cpu-affinity auto (each replica on the cores nearest its GPUs) or off; "
            "a core list names one machine's cores"
        )
    config = task.settle(config)  # NOTE: the task's own refusals first: they say more than "not read"
    check_honoured(task, config)  # an option the task would not read is refused, not ignored
    progress = progress or Progress(config.pipeline.progress)
    if fallback:
        progress.note(fallback)
    with Observed(progress.meter, report_files(config), machine_facts) as observed:
        if config.cluster.engine == "ray":  # NOTE: Ray is imported only when it runs
            from .ray_engine.driver import run_on_ray

            report = run_on_ray(config, task.cluster(), progress=progress, stop=stop)
        else:
            given = RunGiven(device, devices, progress, hooks, ranges, batch_profiler, model, stop, shelf)
            report = task.run(config, given)
        if hasattr(report, "backend"):  # every built-in task's report says which models ran
            report.backend = config.backend
        observed.finish(report)
    return report


def report_files(config: RunConfig) -> ReportFiles:
    return ReportFiles(
        config.report_path, config.report_html, config.output.path, config.metrics_port, config.metrics_linger_s
    )
