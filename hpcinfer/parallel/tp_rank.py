"""`python -m hpcinfer.parallel.tp_rank RANK`: one tensor-parallel rank other than 0, started by
rank 0 (tp.py). It reads its setup, then each step's inputs, from stdin; it loads its shard,
sizes its KV pool with the others, and runs each step's forward on its shard until rank 0 says
the run is over (None) or goes away (the end of stdin). Its figures go to a JSON file for rank
0's report; a failure is its last stderr line, which rank 0 reports with its exit status.
"""

from __future__ import annotations

import json
import pickle
import shutil
import signal
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from ..device import accelerators
from ..device.heap import keep_freed_memory
from ..device.threads import set_torch_threads
from ..engine.kvcache.pools import KVCache
from ..engine.runner import ModelRunner
from ..errors import HpcinferError
from ..models.decoder_embedder import padded_hidden
from ..process_end import run_and_end
from .group import Collectives, RankFailed, Rendezvous, end_group
from .tp import EmbedBatch, RankSetup, load_rank


def serve(setup: RankSetup, rank: int, inbox: object) -> None:
    """Joins the group, loads the shard, then replays rank 0's steps until it ends the run."""
    device = torch.device(setup.devices[rank])
    if device.type == "cuda":
        accelerators.make_current(device)
    elif setup.threads:
        set_torch_threads(setup.threads)
    rdv = Rendezvous(rank, setup.world, setup.port, setup.timeout_s)
    rdv.mark("up")
    group = rdv.join(device)
    comm = Collectives(group, device, lambda exc: RankFailed(f"a collective failed: {exc}"))
    model, layout, blocks, figures = load_rank(setup, rank, rdv, comm)
    cache = KVCache(layout, blocks, device)
    max_model_len = min(model.cfg.max_model_len, blocks * setup.block_size)
    runner = ModelRunner(
        model, cache, setup.max_num_batched_tokens, setup.max_num_seqs, max_model_len, attention=setup.attention
    )
    with torch.inference_mode():
        while True:
            try:
                message = pickle.load(inbox)  # type: ignore[arg-type]
            except EOFError:  # NOTE: rank 0 died (a kill, a Ray actor ended): no one reads its stats dir now
                shutil.rmtree(setup.stats_dir, ignore_errors=True)
                raise RankFailed("rank 0 went away") from None
            if message is None:
                break
            if isinstance(message, EmbedBatch):  # a pooling task's batch: the same decoder forward
                padded_hidden(model, message.ids.to(device))
                figures.steps += 1
                continue
            copies, step = message
            if copies:
                cache.copy_blocks(copies)
            runner.replay(step)
            figures.steps += 1
    figures.collective_s = round(comm.seconds, 4)
    figures.collective_calls, figures.collective_bytes = comm.calls, comm.bytes
    Path(setup.stats_dir, f"rank{rank}.json").write_text(json.dumps(asdict(figures)))
    end_group(group)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C stops rank 0, which ends this rank
    rank = int(sys.argv[1])
    keep_freed_memory()  # NOTE: a rank's process computes as the command line's does
    inbox = sys.stdin.buffer
    try:
        setup = pickle.load(inbox)
        serve(setup, rank, inbox)
    except HpcinferError as exc:
        print(f"hpcinfer: rank {rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    except Exception as exc:
        print(f"hpcinfer: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    run_and_end(main)  # NOTE: rank 0 waits for this process's end (process_end.py)
