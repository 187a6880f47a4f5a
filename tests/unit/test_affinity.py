"""--cpu-affinity: CPU lists parsed and checked against the cores this process may use, split over
CPU replicas, NUMA nodes under auto, and each pipeline thread pinned by its role."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch

from hpcinfer.errors import ConfigError
from hpcinfer.place.affinity import (
    AffinityPlan,
    Cores,
    format_cpu_list,
    numa_nodes,
    parse_cpu_list,
    pin_process,
    resolve_affinity,
    start_tokenizer_pool,
)

from ..conftest import run_job, small_config

EIGHT = tuple(range(8))


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8, 6") == (0, 1, 2, 3, 6, 8)
    assert format_cpu_list((0, 1, 2, 3, 6, 8)) == "0-3,6,8"
    assert format_cpu_list((5,)) == "5"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("1-x", "is not a CPU list"),
        ("3-1", "is not a core range"),
        ("1/0/0/0", "COMPUTE[/TOKENIZE[/HOST]]"),
        ("1//0", "COMPUTE[/TOKENIZE[/HOST]]"),
        ("9", "cores 9 are not available to this process (it may use 0-7)"),
        ("0-3/12-13", "cores 12-13 are not available"),
    ],
)
def test_bad_lists_are_one_line_errors(spec, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        resolve_affinity(spec, ["cpu"], allowed=EIGHT)


def test_off_is_none_and_a_list_fills_its_defaults():
    assert resolve_affinity("off", ["cpu"], allowed=EIGHT) is None
    plan = resolve_affinity("1/0", ["cpu"], allowed=EIGHT)
    assert plan == AffinityPlan((Cores((1,), (0,)),), (0,), (0,))
    assert plan.describe() == "compute on 1, tokenizer on 0, host stages on 0"
    assert resolve_affinity("2-7/1/0", ["cpu"], allowed=EIGHT) == AffinityPlan((Cores(EIGHT[2:], (0,)),), (1,), (0,))
    assert resolve_affinity("0-7", ["cpu"], allowed=EIGHT) == AffinityPlan((Cores(EIGHT, EIGHT),), EIGHT, EIGHT)


def test_cpu_replicas_split_the_compute_cores():
    plan = resolve_affinity("1-7/0", ["cpu", "cpu"], allowed=EIGHT)
    assert [r.compute for r in plan.replicas] == [(1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(ConfigError, match="3 CPU replicas need at least 3 compute cores"):
        resolve_affinity("0-1", ["cpu"] * 3, allowed=EIGHT)


def _nodes(root: Path, lists: list[str]) -> Path:
    for i, cores in enumerate(lists):
        (root / f"devices/system/node/node{i}").mkdir(parents=True)
        (root / f"devices/system/node/node{i}/cpulist").write_text(cores + "\n")
    return root


def test_auto_puts_cpu_replicas_on_numa_nodes(tmp_path):
    root = _nodes(tmp_path, ["0-3", "4-7"])
    assert numa_nodes(root) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    plan = resolve_affinity("auto", ["cpu", "cpu"], allowed=EIGHT, sys_root=root)
    assert [r.compute for r in plan.replicas] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [r.host for r in plan.replicas] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    one = resolve_affinity("auto", ["cpu"], allowed=EIGHT, sys_root=_nodes(tmp_path / "one", ["0-7"]))
    assert one == AffinityPlan((Cores(EIGHT, EIGHT),), EIGHT, EIGHT)  # one node, no GPU: nothing separated


def test_each_thread_is_pinned_by_its_role():
    cores = sorted(os.sched_getaffinity(0))
    first, last = (cores[0],), (cores[-1],)
    plan = AffinityPlan((Cores(last, first),), first, first)
    seen, threads, bound = {}, [], []
    before = torch.get_num_threads()
    init = plan.thread_init(lambda: bound.append(threading.current_thread().name))

    def body() -> None:
        init()
        seen[threading.current_thread().name] = tuple(sorted(os.sched_getaffinity(0)))

    for name in ("execute", "tokenize_0", "write", "stage@cpu#1"):
        threads.append(threading.Thread(target=body, name=name))
        threads[-1].start()
        threads[-1].join()
    torch.set_num_threads(before)
    assert seen == {"execute": last, "tokenize_0": first, "write": first, "stage@cpu#1": first}
    assert len(bound) == 4
    assert tuple(sorted(os.sched_getaffinity(0))) == tuple(cores)  # the calling thread is untouched


def test_the_tokenizer_pool_starts_and_the_caller_keeps_its_cores():
    mine = os.sched_getaffinity(0)
    start_tokenizer_pool(sorted(mine)[:1])
    assert os.sched_getaffinity(0) == mine


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_a_run_pins_tokenize_and_execute_threads(tmp_path, tiny_model, requests_jsonl):
    a, b = sorted(os.sched_getaffinity(0))[:2]
    cfg = small_config(requests_jsonl, tmp_path / "out.parquet", tiny_model, device={"cpu_affinity": f"{b}/{a}"})
    seen: dict[str, set] = {"tokenize": set(), "execute": set(), "write": set()}
    hooks = {name: (lambda item, name=name: seen[name].add(tuple(os.sched_getaffinity(0)))) for name in seen}
    before = torch.get_num_threads()
    try:
        report, table = run_job(cfg, hooks=hooks)
    finally:
        torch.set_num_threads(before)
    assert seen == {"tokenize": {(a,)}, "execute": {(b,)}, "write": {(a,)}}
    assert table.num_rows == 300 and report.cpu_affinity == f"compute on {b}, tokenizer on {a}, host stages on {a}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_the_serial_twin_runs_the_whole_process_on_the_compute_cores(tmp_path, tiny_model, requests_jsonl):
    """--no-overlap: one thread runs every stage, so the process (torch's threads too) takes COMPUTE
    while it runs, and has its cores back after."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    cfg = small_config(
        requests_jsonl,
        tmp_path / "out.parquet",
        tiny_model,
        device={"cpu_affinity": f"{b}/{a}"},
        pipeline={"overlap": False},
    )
    seen: set[tuple[int, ...]] = set()

    def every_thread(item) -> None:  # noqa: ANN001
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                seen.add(tuple(os.sched_getaffinity(int(tid))))

    mine = os.sched_getaffinity(0)
    before = torch.get_num_threads()
    try:
        _, table = run_job(cfg, hooks={"tokenize": every_thread, "execute": every_thread})
    finally:
        torch.set_num_threads(before)
    assert seen == {(b,)} and table.num_rows == 300
    assert os.sched_getaffinity(0) == mine


def test_pin_process_moves_threads_already_running_and_is_undone():
    mine = os.sched_getaffinity(0)
    one = (sorted(mine)[-1],)
    go, seen = threading.Event(), {}

    def running() -> None:
        go.wait()
        seen["cores"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=running)
    thread.start()  # started before the pinning: it carries the old mask until moved
    try:
        pin_process(one)
        go.set()
        thread.join()
        assert seen["cores"] == set(one) and os.sched_getaffinity(0) == set(one)
    finally:
        go.set()
        pin_process(tuple(mine))
    assert os.sched_getaffinity(0) == mine


def test_a_ray_replica_under_auto_pins_itself_near_the_gpus_it_sees(monkeypatch, tmp_path):
    """Ray hands a replica its GPUs (CUDA_VISIBLE_DEVICES); under auto its process goes to the union
    of their PCI slots' local_cpulist, within the cores it may use; nothing where none is known."""
    from hpcinfer.place import affinity

    mine = tuple(sorted(os.sched_getaffinity(0)))
    near = {"cuda:0": mine[:1], "cuda:1": mine[-1:]}
    pinned: list[tuple[int, ...]] = []
    monkeypatch.setattr(affinity, "pin_process", lambda cores: pinned.append(tuple(cores)))
    monkeypatch.setattr(affinity, "gpu_local_cores", lambda device, sys_root: near[device])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert affinity.pin_near_gpus() == tuple(sorted(set(mine[:1] + mine[-1:])))
    assert pinned == [tuple(sorted(set(mine[:1] + mine[-1:])))]
    monkeypatch.setattr(affinity, "gpu_local_cores", lambda device, sys_root: ())
    assert affinity.pin_near_gpus() == () and len(pinned) == 1  # unknown: left alone
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert affinity.pin_near_gpus() == ()


def test_tensor_parallel_and_a_core_list_on_ray_refuse_it(tmp_path, requests_jsonl, tiny_model):
    from dataclasses import replace

    from hpcinfer.api import run
    from hpcinfer.config import ClusterConfig

    cfg = small_config(requests_jsonl, tmp_path / "out.parquet", tiny_model, device={"cpu_affinity": "auto"})
    with pytest.raises(ConfigError, match="not with --tp"):
        run(replace(cfg, task="generate", device=replace(cfg.device, tensor_parallel=2)))
    listed = replace(cfg, device=replace(cfg.device, cpu_affinity="1/0"), cluster=ClusterConfig(engine="ray"))
    with pytest.raises(ConfigError, match="--engine ray takes --cpu-affinity auto"):
        run(listed)
