"""`--tp N` as a run sets it up: which devices form each tensor-parallel group, each group's setup,
and rank 0's engine of each group (parallel/tp.py starts the groups and runs their ranks).

    --devices cpu,cpu,cpu,cpu --tp 2  ->  [cpu, cpu] [cpu, cpu]        2 groups, 2 engines
    --devices all --tp 2 (8 GPUs)     ->  [cuda:0, cuda:1] ... [cuda:6, cuda:7]   4 engines
    --tp 2 (no --devices)             ->  [cpu, cpu] or [cuda:0, cuda:1]          1 engine

Each group is one replica of generation's several-device path (engine/runtime/devices.py): its rank 0 runs an
engine on a thread of the run's process, and the pool dispatches prompts between the groups by
outstanding tokens, as between devices. Each group has a process group (and port) of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..config import RunConfig
from ..device import accelerators
from ..device.threads import set_torch_threads
from ..engine.engine import Engine, EngineConfig
from ..engine.runner import StepInputs
from ..errors import ConfigError
from ..models.decoder_inspect import DecoderInfo
from .decoder import ShardedDecoder, rank_config
from .tp import DEFAULT_TIMEOUT_S, RankFigures, RankSetup, TensorParallel, start_tensor_parallel

MakeEngine = Callable[[ShardedDecoder, EngineConfig], Engine]  # rank 0's engine on its shard


def tensor_groups(config: RunConfig, info: DecoderInfo, devices: list[torch.device]) -> list[list[torch.device]]:
    """The devices of each `--tp N` group: --devices lists N devices per group (len / N groups), else
    one group of N CPU ranks or of cuda:0..N-1. A model that does not divide by N, a device count
    that does not, and combinations not built are refused in one line."""
    n, d = config.device.tensor_parallel, config.device
    if info.gguf:
        raise ConfigError("--tp reads safetensors checkpoints; run a GGUF file with --tp 1")
    rank_config(info.config, n)
    if d.cuda_graphs:
        raise ConfigError("--cuda-graphs with --tp is not built yet (the decode graphs hold no collectives)")
    if d.quantize != "none":
        raise ConfigError(f"--quantize {d.quantize} with --tp is not built yet: give --quantize none")
    if d.devices:
        if len(devices) % n:
            raise ConfigError(
                f"--tp {n} with --devices of {len(devices)} devices: give a multiple of {n} "
                f"(each {n} devices in turn form one group)"
            )
        if devices[0].type == "cuda" and len({str(x) for x in devices}) != len(devices):
            raise ConfigError(f"--tp {n}: each rank needs a device of its own (got {d.devices})")
        return [devices[i : i + n] for i in range(0, len(devices), n)]
    if devices[0].type == "cpu":
        return [[devices[0]] * n]
    visible = accelerators.cuda_count()
    if visible < n:
        raise ConfigError(f"--tp {n} needs {n} GPUs; {visible} visible")
    return [[torch.device("cuda", i) for i in range(n)]]


def rank_threads(config: RunConfig, groups: list[list[torch.device]]) -> int | None:
    """Each CPU rank's intra-op threads: the machine's (or --threads) shared among every group's CPU ranks."""
    cpus = sum(x.type == "cpu" for group in groups for x in group)
    return max(1, (config.device.threads or torch.get_num_threads()) // cpus) if cpus else None


def rank_setup(
    config: RunConfig,
    info: DecoderInfo,
    devices: list[torch.device],
    dtype: torch.dtype,
    engine: EngineConfig,
    threads: int | None,
    group: int = 0,
) -> RankSetup:
    """One group's setup for this run."""
    return RankSetup(
        info=info,
        devices=tuple(str(x) for x in devices),
        dtype=dtype,
        port=0,
        timeout_s=config.device.step_timeout or DEFAULT_TIMEOUT_S,
        threads=threads,
        kv_memory=engine.kv_cache_memory,
        block_size=engine.block_size,
        kv_storage=engine.kv_storage,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_num_seqs=engine.max_num_seqs,
        attention=engine.attention,
        page_windows=engine.page_windows,
        group=group,
    )


def tp_engine_config(engine: EngineConfig, tp: TensorParallel) -> EngineConfig:
    """Rank 0's engine: the KV pool every rank agreed on (in blocks of the layout every rank has,
    paged windows or not: `rank_setup`), and step by step (the other ranks take each step's inputs
    from the host, so a step's tokens must be there before the next one)."""
    return replace(engine, kv_cache_memory=tp.kv_blocks * tp.kv_bytes_per_block, ahead=False)


def attach(engine: Engine, tp: TensorParallel) -> None:
    """Rank 0's engine sends each step's inputs (and the KV block copies made since the last step)
    to the other ranks before its forward."""
    cache = engine.cache
    if cache.num_blocks != tp.kv_blocks:  # NOTE: a block id rank 0 hands out must be a block on every rank
        raise RuntimeError(f"rank 0's KV pool has {cache.num_blocks} blocks, the ranks agreed on {tp.kv_blocks}")
    cache.copied = []

    def mirror(step: StepInputs) -> None:
        copies, cache.copied = cache.copied or [], []
        tp.mirror(copies, step)

    engine.runner.mirror = mirror


def start_groups(
    setups: list[RankSetup], engine: EngineConfig, make: MakeEngine
) -> tuple[list[Engine], list[TensorParallel]]:
    """Starts each group (one after the other: their loads would compete for the same disk and cores)
    and builds its rank 0's engine; on any failure the groups started are stopped."""
    engines: list[Engine] = []
    groups: list[TensorParallel] = []
    try:
        for setup in setups:
            tp = start_tensor_parallel(setup)
            groups.append(tp)
            if setup.devices[0] == "cpu" and setup.threads:
                set_torch_threads(setup.threads)  # NOTE: this thread's; each engine thread sets its own
            built = make(tp.model, tp_engine_config(engine, tp))
            attach(built, tp)
            engines.append(built)
    except BaseException:
        close_groups(groups, [0] * len(groups))
        raise
    return engines, groups


def start_run_groups(
    config: RunConfig,
    info: DecoderInfo,
    groups: list[list[torch.device]],
    dtype: torch.dtype,
    engine: EngineConfig,
    make: MakeEngine,
) -> tuple[list[Engine], list[TensorParallel]]:
    """Every --tp group of a run, each rank's threads its share of the machine's."""
    threads = rank_threads(config, groups)
    setups = [rank_setup(config, info, devices, dtype, engine, threads, i) for i, devices in enumerate(groups)]
    return start_groups(setups, engine, make)


def close_groups(groups: list[TensorParallel], steps: list[int]) -> list[RankFigures]:
    """Stops every group's ranks; every rank's figures, group by group, rank 0 first."""
    return [f for tp, n in zip(groups, steps, strict=True) for f in tp.close(n)]


def replica_engine(
    config: RunConfig,
    info: DecoderInfo,
    device: torch.device,
    dtype: torch.dtype,
    engine: EngineConfig,
    make: MakeEngine,
) -> tuple[Engine, TensorParallel, int | None]:
    """A Ray replica's `--tp N` group: rank 0 in the actor, ranks 1..N-1 processes it starts, on
    the devices Ray gave the actor (N CPU ranks, or its N GPUs: --gpus-per-replica N). Returns
    rank 0's engine, the group, and rank 0's intra-op threads."""
    groups = tensor_groups(config, info, [device])
    engines, started = start_run_groups(config, info, groups, dtype, engine, make)
    return engines[0], started[0], rank_threads(config, groups)
