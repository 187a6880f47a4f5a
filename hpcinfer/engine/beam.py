"""Beam search over the paged KV cache, step for step as transformers' `generate(num_beams=...)`.

The prompt is prefilled once (its cached prefix reused); each step runs the live beams as decodes
of one batch, then, as transformers does: the beams' log-probabilities plus their running scores,
the top K = max(2, 1 + EOS tokens) x beams continuations over all beams, the best `beams`
continuations that did not stop run on, and those of the top `beams` that stopped (EOS, max_tokens,
the context) join the finished hypotheses, scored by their log-probability over their length to
the power `length_penalty`; the search ends when no running beam can beat the worst finished one
(transformers' default `early_stopping=False` heuristic), or nothing can continue.

A beam that continues another is a fork of it in the block manager: the full blocks shared by
reference (every beam shares the prompt's), the last, partly filled block copied; a beam that no
continuation picked frees its blocks. One request's beams run together, between the continuous
batch's steps.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import torch

from .scheduler import Chunk, StepPlan
from .sequence import Sequence, Status

NEG = -1.0e9  # transformers' "never": a score no hypothesis reaches


def beam_search(engine: Any, seq: Sequence, eos: Collection[int]) -> None:
    """Runs `seq`'s beam search to its end; `seq` ends holding the best hypothesis (finish_reason
    "stop" when it ends with EOS, else "length")."""
    params = seq.params
    beams, penalty = params.beam_width, params.length_penalty
    prompt_len = len(seq.tokens)
    ends = frozenset(() if params.ignore_eos else eos)
    keep = max(2, 1 + len(ends)) * beams
    logits = _prefill(engine, seq)
    if logits is None:
        _finish(engine, seq, [], "length")
        return
    vocab = logits.shape[-1]
    rows = logits.expand(beams, vocab)  # NOTE: every beam starts as the prompt; beam 0 alone scores 0
    running: list[Sequence] = [seq] * beams
    running_scores = torch.full((beams,), NEG)
    running_scores[0] = 0.0
    finished_scores = torch.full((beams,), NEG)
    finished_tokens: list[list[int]] = [[] for _ in range(beams)]
    finished_done = torch.zeros(beams, dtype=torch.bool)
    top_mask = torch.arange(keep) < beams
    improvable, cur_len = True, prompt_len
    while True:
        scores = torch.log_softmax(rows.float(), dim=-1) + running_scores[:, None]
        top_scores, top_index = torch.topk(scores.reshape(-1), keep)
        parents, tokens = (top_index // vocab).tolist(), (top_index % vocab).tolist()
        generated = cur_len + 1 - prompt_len
        at_end = generated >= params.max_tokens or cur_len + 1 >= engine.max_model_len
        hits = torch.tensor([at_end or t in ends for t in tokens])
        # the beams that run on: the best continuations that did not stop
        running_top = top_scores + hits.float() * NEG
        chosen = torch.topk(running_top, beams).indices.tolist()
        # the hypotheses that finished: of the top `beams`, those that stopped, by length-penalized score
        final = top_scores / (generated**penalty) + (0.0 if improvable else NEG)
        final = final + (~(hits & top_mask)).float() * NEG
        hypotheses = [running[parents[j]].tokens[prompt_len:] + [tokens[j]] for j in range(keep)]
        merged = torch.cat((finished_scores, final))
        pick = torch.topk(merged, beams).indices.tolist()
        done = torch.cat((finished_done, hits & top_mask))
        every = finished_tokens + hypotheses
        finished_scores, finished_done, finished_tokens = merged[pick], done[pick], [every[i] for i in pick]
        cur_len += 1
        new_scores = running_top[chosen]
        worst = torch.where(finished_done, finished_scores.min(), torch.tensor(NEG))
        improvable = improvable and bool((new_scores[0] / ((cur_len - prompt_len) ** penalty) > worst).any())
        if not improvable or bool(hits.all()):
            break
        step = _continue(engine, running, [(parents[j], tokens[j]) for j in chosen])
        if step is None:  # NOTE: the KV pool cannot hold the beams now: the best so far is the answer
            break
        running, rows = step
        running_scores = new_scores
    best = finished_tokens[0] if bool(finished_done[0]) else hypotheses[chosen[0]]
    for beam in {id(s): s for s in running}.values():
        engine.blocks.free(beam)
    _finish(engine, seq, best, "stop" if best and best[-1] in ends else "length")


def _prefill(engine: Any, seq: Sequence) -> torch.Tensor | None:
    """The prompt's K/V (its cached prefix taken) and its last position's logits [1, vocab]; None
    when the pool cannot hold it now."""
    blocks = engine.blocks
    hits, pending = blocks.match(seq)
    if pending:
        hits = []
    todo = len(seq.tokens) - len(hits) * blocks.block_size
    if todo <= 0 or not blocks.can_admit(hits, seq, todo):
        return None
    blocks.admit(seq, hits, todo)
    logits = engine.runner.run(StepPlan(prefills=[Chunk(seq, seq.num_computed, todo)]))
    seq.num_computed = len(seq.tokens)
    blocks.commit()
    return logits


def _continue(
    engine: Any, running: list[Sequence], picks: list[tuple[int, int]]
) -> tuple[list[Sequence], torch.Tensor] | None:
    """The next step's beams, each a fork of its parent beam plus its token, run through the model
    as one batch of decodes: (beams, their logits [beams, vocab]). The old beams are freed. None
    when the pool cannot give each new beam the one block it needs (a copied last block, or a
    fresh one at a block boundary); the old beams are then kept, for the caller to free."""
    blocks = engine.blocks
    if len(picks) * blocks.blocks_per_position > blocks.num_free:
        return None
    children, copies = [], []
    for parent_index, token in picks:
        parent = running[parent_index]
        child = Sequence(parent.seq_id, parent.tokens + [token], parent.params, parent.tag, priority=parent.priority)
        child.num_prompt = parent.num_prompt
        copies += blocks.fork(parent, child, parent.num_computed)
        child.num_computed = parent.num_computed
        child.status = Status.RUNNING
        children.append(child)
    if copies:
        engine.cache.copy_blocks(copies)
    for old in {id(s): s for s in running}.values():
        blocks.free(old)  # NOTE: what the new beams share stays theirs by reference
    for child in children:
        blocks.grow(child, 1)
    logits = engine.runner.run(StepPlan(decodes=[Chunk(child, child.num_computed, 1) for child in children]))
    for child in children:
        child.num_computed += 1
    blocks.commit()
    return children, logits


def _finish(engine: Any, seq: Sequence, answer: list[int], reason: str) -> None:
    """`seq` ends with `answer` after its prompt, its blocks free."""
    engine.blocks.free(seq)
    del seq.tokens[seq.num_prompt :]
    seq.tokens.extend(answer)
    seq.stop_token = reason == "stop"
    seq.status, seq.finish_reason = Status.FINISHED, reason
    seq.finish_s = time.perf_counter()
    seq.first_token_s = seq.first_token_s or seq.finish_s
