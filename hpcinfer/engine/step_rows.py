"""Which rows of a step's flat batch are what (the runner's order: decodes by context width, then
prefill chunks): the rows that are image tokens, each row's LoRA adapter, the rows whose requests
ask for prompt log-probabilities. Host-side reads of a StepPlan, beside the device work in runner.py."""

from __future__ import annotations

import numpy as np
import torch

from .scheduler import Chunk, StepPlan


def media_rows(plan: StepPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The flat rows of the step's prefill chunks that are image tokens, and their images' vectors
    (models/vlm.py): they replace those rows' token embeddings; None when the step has none."""
    rows, vectors = [], []
    offset = len(plan.decodes)  # prefill chunks follow the decodes in the flat batch
    for chunk in plan.prefills:
        media = chunk.seq.params.media
        if media is not None:
            lo, hi = np.searchsorted(media.positions, [chunk.start, chunk.start + chunk.length])
            if hi > lo:
                rows.append(media.positions[lo:hi] - chunk.start + offset)
                vectors.append(media.vectors[str(device)][lo:hi])
        offset += chunk.length
    if not rows:
        return None
    return torch.from_numpy(np.concatenate(rows)).to(device), torch.cat(vectors)


def row_adapters(plan: StepPlan) -> list[int]:
    """Each row's LoRA adapter, in the step's row order (`host_inputs`: decodes by context width, then prefills)."""
    decodes = sorted(plan.decodes, key=lambda c: len(c.seq.block_table))
    rows = [c.seq.params.lora for c in decodes]
    for chunk in plan.prefills:
        rows += [chunk.seq.params.lora] * chunk.length
    return rows


def logprob_chunks(plan: StepPlan) -> list[tuple[Chunk, int, int]]:
    """The prefill chunks whose requests ask for prompt log-probabilities, with the flat offset and
    count of their rows that have a next prompt token."""
    out, offset = [], len(plan.decodes)  # prefill chunks follow the decodes in the flat batch
    for chunk in plan.prefills:
        seq, start = chunk.seq, chunk.start
        stop = min(start + chunk.length, seq.num_prompt - 1)  # a position's next token must be a prompt token
        if seq.params.prompt_logprobs is not None and stop > start:
            out.append((chunk, offset, stop - start))
        offset += chunk.length
    return out
