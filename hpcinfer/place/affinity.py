"""`--cpu-affinity auto|off|LIST`: which cores the compute threads, the tokenizer's threads and
the host stages run on, resolved once at start-up.

LIST is `COMPUTE[/TOKENIZE[/HOST]]`, each a Linux CPU list (`0-3,8`): the execute stage's
thread and torch's threads under it on COMPUTE, the tokenize stage and the tokenizer library's
own (Rayon) threads on TOKENIZE (default: COMPUTE), the other stages (read, plan, stage, write,
dispatch) on HOST (default: TOKENIZE). `auto` binds each replica's host and compute threads to
the cores nearest its device where the machine says which those are (a GPU's PCI
`local_cpulist`, one NUMA node per CPU replica); on one NUMA node without GPUs it separates
nothing (on 2 cores, giving the tokenizer a core of its own was measured slower: README).

Generation reads and tokenizes its requests ahead on a thread of its own (TOKENIZE). One engine
steps on the loop's thread, with every thread of the process moved to COMPUTE first (torch's
OpenMP workers among them); several engines step on a thread each (their replica's COMPUTE), fed
by the loop on HOST. A Ray replica under `auto` moves its whole process to the cores nearest the
GPUs Ray gave it (`pin_near_gpus`); a LIST names one machine's cores, so Ray takes `auto` or `off`.

NOTE: Linux applies `sched_setaffinity(0, ...)` to the calling thread only, and a new thread
starts with its creator's mask: each pipeline thread pins itself first thing, and torch's
OpenMP workers, created by the compute thread's first parallel region, inherit its cores.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import accelerators
from ..device.threads import set_torch_threads
from ..errors import ConfigError

SYS = Path("/sys")


@dataclass(frozen=True, slots=True)
class Cores:
    """One replica's cores: its compute thread (and torch's threads) and its host stages."""

    compute: tuple[int, ...]
    host: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AffinityPlan:
    replicas: tuple[Cores, ...]  # one per device replica, in device order
    tokenize: tuple[int, ...]  # the tokenize stage and the tokenizer's own threads
    host: tuple[int, ...]  # stages every replica shares: read, plan, dispatch, write

    def describe(self) -> str:
        compute = " | ".join(format_cpu_list(r.compute) for r in self.replicas)
        tokenize, host = format_cpu_list(self.tokenize), format_cpu_list(self.host)
        return f"compute on {compute}, tokenizer on {tokenize}, host stages on {host}"

    def thread_init(self, bind: Callable[[], None] | None = None, replica: int = 0) -> Callable[[], None]:
        """A pipeline thread's first call: pin it by its role (read from its thread name, which the
        pipeline sets to its stage, `stage@device` in a fan-out branch), then `bind` (the device's)."""

        def init() -> None:
            name = threading.current_thread().name
            stage = name.split("@", 1)[0].rsplit("_", 1)[0]  # ThreadPoolExecutor workers: tokenize_0
            if stage == "execute":
                cores = self.replicas[replica].compute
                pin_thread(cores)
                set_torch_threads(len(cores))  # NOTE: --threads (or a replica's share), via bind, wins
            elif stage == "tokenize":
                pin_thread(self.tokenize)
            else:
                pin_thread(self.replicas[replica].host if "@" in name else self.host)
            if bind is not None:
                bind()

        return init


@contextmanager
def pinned(cores: Sequence[int] | None, threads: int | None = None, whole_process: bool = False) -> Iterator[None]:
    """The calling thread on `cores` (with `whole_process`, every thread of the process), and
    torch's thread count `threads` for it, inside the block; as they were after it. Nothing
    changes where `cores` is None (`--cpu-affinity off`)."""
    if cores is None:
        yield
        return
    mine, before = os.sched_getaffinity(0), torch.get_num_threads()
    pin = pin_process if whole_process else pin_thread
    pin(cores)
    if threads:
        set_torch_threads(threads)
    try:
        yield
    finally:
        pin(tuple(mine))
        set_torch_threads(before)


def pin_thread(cores: Sequence[int]) -> None:
    """The calling thread (and the threads it starts from now on) on `cores`."""
    os.sched_setaffinity(0, cores)


def device_spec(device: str, kind: str) -> str:
    """What --cpu-affinity auto looks a device's cores up by: 'cuda:1' for a GPU, else its kind."""
    return device if kind == "cuda" else kind


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8); raises ConfigError on anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"--cpu-affinity: {text!r} is not a CPU list (e.g. 0-3,8)") from None
        if first < 0 or last < first:
            raise ConfigError(f"--cpu-affinity: {part.strip()!r} is not a core range")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    out, cores = [], sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def _read_list(path: Path) -> tuple[int, ...]:
    try:
        text = path.read_text().strip()
        return parse_cpu_list(text) if text else ()
    except (OSError, ConfigError):
        return ()


def numa_nodes(sys_root: Path = SYS) -> list[tuple[int, ...]]:
    """Each NUMA node's cores, in node order (empty without sysfs' node directory)."""
    nodes = sorted((sys_root / "devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    return [cores for node in nodes if (cores := _read_list(node / "cpulist"))]


def gpu_local_cores(device: str, sys_root: Path = SYS) -> tuple[int, ...]:
    """The cores nearest a CUDA device (its PCI slot's `local_cpulist`); () when unknown."""
    if not device.startswith("cuda") or not accelerators.cuda_available():
        return ()
    props = accelerators.cuda_properties(int(device.partition(":")[2] or 0))
    if not hasattr(props, "pci_bus_id"):
        return ()
    # NOTE: sysfs names a PCI slot domain:bus:device.function, in lower-case hex
    name = f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return _read_list(sys_root / "bus/pci/devices" / name / "local_cpulist")


def pin_process(cores: Sequence[int], proc: Path = Path("/proc/self/task")) -> None:
    """Every thread of this process on `cores`, those running now and (inheriting) those to come.

    NOTE: for a process of its own, a Ray replica: by then Ray's and torch's threads exist, and
    `sched_setaffinity` takes a thread id as well as a process id.
    """
    try:
        threads = [int(tid) for tid in os.listdir(proc)]
    except OSError:
        threads = [0]
    for tid in threads:
        with suppress(OSError):  # ended since it was listed
            os.sched_setaffinity(tid, cores)


def pin_near_gpus(sys_root: Path = SYS) -> tuple[int, ...]:
    """`--cpu-affinity auto` in a replica's own process (Ray): the whole process on the cores nearest
    the GPUs it sees; returns them, or () where it sees none or the machine does not say (nothing
    is pinned then)."""
    near: set[int] = set()
    for index in range(accelerators.cuda_count()):
        near.update(gpu_local_cores(f"cuda:{index}", sys_root))
    cores = tuple(sorted(near & os.sched_getaffinity(0)))
    if cores:
        pin_process(cores)
    return cores


def resolve_affinity(
    spec: str, devices: Sequence[str], allowed: Sequence[int] | None = None, sys_root: Path = SYS
) -> AffinityPlan | None:
    """The plan for `--cpu-affinity spec` over the replicas' devices ('cpu', 'cuda:1', ...); None
    for `off`. Raises ConfigError for a malformed LIST or cores this process may not use."""
    spec = spec.strip()
    if spec == "off":
        return None
    usable = tuple(sorted(allowed if allowed is not None else os.sched_getaffinity(0)))
    if spec == "auto":
        return _auto(devices, usable, sys_root)
    parts = spec.split("/")
    if len(parts) > 3 or not all(p.strip() for p in parts):
        raise ConfigError(f"--cpu-affinity: {spec!r} is not auto, off or COMPUTE[/TOKENIZE[/HOST]] (e.g. 1/0)")
    compute, tokenize, host = (parse_cpu_list(p) for p in (parts + parts[-1:] * 2)[:3])
    outside = sorted(set(compute + tokenize + host) - set(usable))
    if outside:
        raise ConfigError(
            f"--cpu-affinity: cores {format_cpu_list(outside)} are not available to this process "
            f"(it may use {format_cpu_list(usable)})"
        )
    cpus = sum(d == "cpu" for d in devices)
    if cpus > len(compute):
        raise ConfigError(f"--cpu-affinity: {cpus} CPU replicas need at least {cpus} compute cores")
    shares, k = [], 0
    for d in devices:  # NOTE: CPU replicas split the compute cores; GPU replicas' launchers share them
        if d == "cpu":
            n = len(compute) * (k + 1) // cpus - len(compute) * k // cpus
            start = len(compute) * k // cpus
            shares.append(Cores(compute[start : start + n], host))
            k += 1
        else:
            shares.append(Cores(compute, host))
    return AffinityPlan(tuple(shares), tokenize, host)


def _auto(devices: Sequence[str], usable: tuple[int, ...], sys_root: Path) -> AffinityPlan:
    """Each replica on the cores nearest its device, where the machine says; else every usable core."""
    nodes = [n for node in numa_nodes(sys_root) if (n := tuple(c for c in node if c in usable))]
    replicas, cpu_index = [], 0
    for d in devices:
        near = tuple(c for c in gpu_local_cores(d, sys_root) if c in usable)
        if d == "cpu" and len(nodes) > 1 and sum(x == "cpu" for x in devices) > 1:
            near = nodes[cpu_index % len(nodes)]
            cpu_index += 1
        cores = near or usable
        replicas.append(Cores(cores, cores))
    return AffinityPlan(tuple(replicas), usable, usable)


def start_tokenizer_pool(cores: Sequence[int]) -> None:
    """Creates the tokenizers library's Rayon pool with one thread per core of `cores`, its threads
    inheriting those cores (a thread starts with its creator's mask).

    NOTE: the pool is global and made on the first parallel encode; where this process already
    tokenized (a tune sample), it stays as it was. RAYON_NUM_THREADS is only read at that moment.
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    os.environ.setdefault("RAYON_NUM_THREADS", str(len(cores)))
    with pinned(cores):
        Tokenizer(WordLevel({"a": 0}, unk_token="a")).encode_batch(["a", "a"])
