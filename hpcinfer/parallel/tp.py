"""Tensor parallelism (`--tp N`), rank 0's side: it starts ranks 1..N-1 as processes of its own,
loads its shard beside theirs, and runs the engine; each step's inputs go to the other ranks,
which run the same forward on their shards (tp_rank.py).

    rank 0: scheduler, block manager, sampler, I/O   ranks 1..N-1: shard, KV pool, runner
      runner.run(plan) -> host_inputs ──stdin pipe──► runner.replay(inputs)
                          forward  ◄──all-reduces──►  forward
                          logits   ◄──── gather ────  logits (their vocabulary rows)

The inputs travel on each rank's stdin (pickled arrays, a few KB a step), not as a collective:
a rank waits for its next step as long as rank 0 has nothing to run, without a timeout firing,
and it sees rank 0 die as the end of its stdin. Every collective has the group's timeout; a rank
that dies closes its sockets and fails the step's collective at once. Rank 0 then names the
rank that died (its exit status, the last line it wrote) and the run ends as after any device
error: committed windows stay, `--resume` finishes the rest. Which devices form the groups, and
rank 0's engine, are set up in tp_groups.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..engine.kvcache.pools import KVLayout, size_pool
from ..engine.runner import StepInputs
from ..files.scratch import ScratchDir
from ..models.decoder_inspect import DecoderInfo
from .decoder import ShardedDecoder
from .group import Backend, Collectives, RankFailed, Rendezvous, end_group, free_port
from .shard_loader import load_shard

DEFAULT_TIMEOUT_S = 600.0  # every collective's, when --step-timeout is off
EXIT_WAIT_S = 5.0  # how long rank 0 waits for a failed collective's rank to show as exited


@dataclass(frozen=True, slots=True)
class RankSetup:
    """What every rank needs to load its shard and run steps (sent to ranks 1..N-1 on stdin)."""

    info: DecoderInfo
    devices: tuple[str, ...]  # rank r runs on devices[r]
    dtype: torch.dtype
    port: int
    timeout_s: float
    threads: int | None
    kv_memory: int | float | None
    block_size: int
    kv_storage: torch.dtype | None
    max_num_batched_tokens: int
    max_num_seqs: int
    attention: str
    vocab_parallel: bool = True
    # sliding-window layers' blocks freed behind the window (engine/kvcache/windowed_blocks.py): the
    # same layout on every rank, whose copies and tables rank 0 sends with each step
    page_windows: bool = False
    stats_dir: str = ""
    group: int = 0  # which of the run's groups (--devices of several groups)

    @property
    def world(self) -> int:
        return len(self.devices)


@dataclass(frozen=True, slots=True)
class EmbedBatch:
    """A pooling task's batch for ranks 1..N-1 (`--tp N --task embed` on a decoder embedder): the
    right-padded ids they run the same decoder forward on (models/decoder_embedder.padded_hidden)."""

    ids: torch.Tensor  # [rows, width], on the CPU


@dataclass(slots=True)
class RankFigures:
    """One rank's memory and collective time (the report's `tensor_parallel` rows)."""

    rank: int
    device: str
    group: int = 0
    weight_bytes: int = 0
    kv_pool_bytes: int = 0
    rss_after_load_bytes: int = 0
    collective_s: float = 0.0
    collective_calls: int = 0
    collective_bytes: int = 0
    steps: int = 0


def rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_rank(
    setup: RankSetup, rank: int, rdv: Rendezvous, comm: Collectives, check: Any = lambda: None
) -> tuple[ShardedDecoder, KVLayout, int, RankFigures]:
    """Rank `rank`'s shard, and the KV blocks every rank holds: each sizes its pool for its own KV
    heads and device, and the smallest count is every rank's (a block is one slot range on all)."""
    device = torch.device(setup.devices[rank])
    model = load_shard(setup.info, comm, device, setup.dtype, setup.vocab_parallel)
    figures = RankFigures(rank, str(device), setup.group, model.weight_bytes, rss_after_load_bytes=rss_bytes())
    rdv.mark("loaded")
    if rank == 0:
        rdv.wait("loaded", check)
    layout = KVLayout.of(model.cfg, setup.block_size, setup.dtype, setup.kv_storage, setup.page_windows)
    blocks = comm.all_min(size_pool(layout, setup.kv_memory, device))
    figures.kv_pool_bytes = blocks * layout.bytes_per_block
    return model, layout, blocks, figures


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1: starts them, sends each step, watches them, stops them."""

    def __init__(self, setup: RankSetup) -> None:
        self.scratch = ScratchDir("tp")
        self.stats_dir = Path(self.scratch.name)
        self.setup = setup = replace(setup, stats_dir=str(self.stats_dir))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.failed: RankFailed | None = None
        for rank in range(1, setup.world):
            log = open(self.stats_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 (the child owns it)
            cmd = [sys.executable, "-m", "hpcinfer.parallel.tp_rank", str(rank)]
            # NOTE: the ranks ignore SIGINT (tp_rank.py): Ctrl-C stops rank 0, which stops them.
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=log)
            log.close()
        for rank in self.procs:
            self._write(rank, setup)

    def check(self) -> None:
        """Raises RankFailed when a rank has exited."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                raise self._died(rank, proc.returncode)

    def failure(self, exc: BaseException) -> RankFailed:
        """The error a failed collective (or pipe) becomes: the rank that died, when one did."""
        if self.failed is not None:
            return self.failed
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline:
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    self.failed = self._died(rank, proc.returncode)
                    return self.failed
            time.sleep(0.05)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.failed = RankFailed(f"tensor-parallel step failed ({first[:200]}); committed windows are kept: --resume")
        return self.failed

    def send(self, copies: list[tuple[int, int]], step: StepInputs) -> None:
        for rank in self.procs:
            self._write(rank, (copies, step))

    def send_batch(self, batch: EmbedBatch) -> None:
        for rank in self.procs:
            self._write(rank, batch)

    def close(self) -> list[RankFigures]:
        """Ends every rank (a clean end after the last step; killed if it does not end) and returns
        the figures of those that ended cleanly."""
        for rank, proc in self.procs.items():
            if proc.poll() is None and self.failed is None:
                with contextlib.suppress(RankFailed):
                    self._write(rank, None)
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        figures = []
        for rank, proc in self.procs.items():
            try:
                proc.wait(timeout=30.0 if self.failed is None else 2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            file = self.stats_dir / f"rank{rank}.json"
            if file.is_file():
                figures.append(RankFigures(**json.loads(file.read_text())))
        self.scratch.cleanup()
        return figures

    def _write(self, rank: int, message: object) -> None:
        proc = self.procs[rank]
        assert proc.stdin is not None
        try:
            pickle.dump(message, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self.failure(exc) from None

    def _died(self, rank: int, code: int) -> RankFailed:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        said = _last_line(self.stats_dir / f"rank{rank}.log")
        detail = f": {said}" if said else ""
        return RankFailed(
            f"tensor-parallel rank {rank} ({self.setup.devices[rank]}) died ({how}){detail}; "
            "committed windows are kept: rerun with --resume"
        )


def _last_line(file: Path) -> str:
    try:
        lines = [line for line in file.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


@dataclass(slots=True)
class TensorParallel:
    """Rank 0 of a running group: its shard, the agreed KV blocks, the other ranks' processes."""

    model: ShardedDecoder
    comm: Collectives
    group: Backend
    ranks: RankProcesses
    kv_blocks: int
    kv_bytes_per_block: int
    figures: RankFigures
    each: list[RankFigures] = field(default_factory=list)  # every rank's, after `close`

    def mirror(self, cache_copies: list[tuple[int, int]], step: StepInputs) -> None:
        self.ranks.send(cache_copies, step)

    def close(self, steps: int) -> list[RankFigures]:
        """Stops the other ranks and leaves the group; every rank's figures, rank 0 first."""
        self.figures.collective_s = round(self.comm.seconds, 4)
        self.figures.collective_calls, self.figures.collective_bytes = self.comm.calls, self.comm.bytes
        self.figures.steps = steps
        others = self.ranks.close()
        end_group(self.group)
        self.each = [self.figures, *sorted(others, key=lambda f: f.rank)]
        return self.each


def start_tensor_parallel(setup: RankSetup) -> TensorParallel:
    """Starts ranks 1..N-1, joins the group as rank 0, loads rank 0's shard; on any failure the
    ranks started are stopped and the error names the rank that failed."""
    setup = replace(setup, port=free_port())
    ranks = RankProcesses(setup)
    group = None
    try:
        rdv = Rendezvous(0, setup.world, setup.port, setup.timeout_s)
        rdv.wait("up", ranks.check)
        group = rdv.join(torch.device(setup.devices[0]))
        comm = Collectives(group, torch.device(setup.devices[0]), ranks.failure)
        model, layout, blocks, figures = load_rank(setup, 0, rdv, comm, ranks.check)
    except BaseException:
        ranks.close()
        end_group(group)
        raise
    return TensorParallel(model, comm, group, ranks, blocks, layout.bytes_per_block, figures)
