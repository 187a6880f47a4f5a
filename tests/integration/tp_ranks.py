"""Rank processes for the tensor-parallel model tests: each loads its shard of tiny checkpoints and
runs whole sequences (no KV cache); rank 0 saves the logits and greedy tokens for the test to compare.

`python -m tests.integration.tp_ranks ARGS.json RANK`: one rank, its arguments (`run_rank`'s but
the rank) in a JSON file; started so, a rank forks from the warm server (tests/fixtures/warm_cli.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hpcinfer.models.attention import DenseCausalAttention
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.parallel.group import Collectives, Rendezvous, end_group
from hpcinfer.parallel.shard_loader import load_shard


def run_rank(
    rank: int, world: int, port: int, ckpts: list[str], prompts: list[list[int]], steps: int, out: str
) -> None:
    torch.set_num_threads(1)
    rdv = Rendezvous(rank, world, port, 60.0)
    group = rdv.join(torch.device("cpu"))
    comm = Collectives(group, torch.device("cpu"))
    results = {}
    for path in ckpts:
        for vocab_parallel in (True, False):
            model = load_shard(inspect_decoder(Path(path)), comm, torch.device("cpu"), torch.float32, vocab_parallel)
            logits, tokens = [], []
            with torch.inference_mode():
                for prompt in prompts:
                    seq = list(prompt)
                    for step in range(steps):
                        ids = torch.tensor(seq)
                        hidden = model(ids, torch.arange(len(seq)), DenseCausalAttention.of(model.cfg))
                        rows = model.logits(hidden if step == 0 else hidden[-1:])
                        if step == 0:
                            logits.append(rows)
                        token = torch.tensor([int(rows[-1].argmax()) if rank == 0 else 0])
                        comm.broadcast(token)
                        seq.append(int(token))
                    tokens.append(seq[len(prompt) :])
            results[(path, vocab_parallel)] = (logits, tokens, model.weight_bytes)
    if rank == 0:
        torch.save(results, out)
    end_group(group)


if __name__ == "__main__":
    arguments = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    run_rank(int(sys.argv[2]), **arguments)
