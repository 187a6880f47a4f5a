"""Speculative decoding: by prompt lookup (n-grams), a running sequence proposes the tokens that
followed the last time its latest n tokens appeared (in its prompt or its answer); with a draft
model (draft.py), the draft's greedy guesses are the proposals. One forward over the sequence's
last token and the proposals verifies them all.

The proposals ride in the sequence's own tokens for one step (`Sequence.draft` of them): the
scheduler then gives the sequence a chunk of 1 + k tokens, as it gives a prompt chunk (each
position attends to the cache and to the chunk's earlier positions), and the runner keeps the
model's choice at every position of that chunk (`Sequence.verify`). `accept` keeps the proposals
the model would have chosen itself, in order, and the model's own token after the last of them:
the answer is token for token the greedy answer without speculation, in fewer forwards when the
answer copies its prompt (extraction, rewriting, summaries).

A sampled sequence keeps each proposal with the probability the model gives it (after its
temperature, top-k, top-p and min-p), and where it refuses one draws from the model's distribution
without that token, then stops (`accept_sampled`): with a proposal that is a single token, this is
speculative sampling's rule, so the answer's tokens are distributed exactly as without
speculation. A penalized, grammar-held, logprob-asking or n > 1 request decodes one token a step,
exactly as without it. A step that may carry proposals runs step by step (not a step ahead: its
proposals follow the last token), and only while the batch is small (a large batch is
compute-bound: verifying k more tokens each would cost more than it saves). Proposals never fill
a KV block: a block is registered in the prefix cache only when full, so a rejected proposal
never reaches the cache; its K/V are overwritten when the real token reaches that position.
"""

from __future__ import annotations

import torch

from .draft import DraftModel
from .sample.sampling import draw, filtered_probs
from .scheduler import Scheduler, StepPlan
from .sequence import PENDING, Sequence

MAX_NGRAM, MIN_NGRAM = 3, 1
MOST_SPECULATING = 4  # sequences running: beyond, a step is compute-bound and speculation is off
# While the recent acceptance is below LOW_RATE, proposing costs more than it saves (a draft model's
# forwards, longer verifying chunks): speculation rests REST_STEPS steps, then proposes once again.
LOW_RATE, REST_STEPS = 0.15, 16


def propose(tokens: list[int], k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens (n from
    MAX_NGRAM down to MIN_NGRAM); none when they never occurred before."""
    if k <= 0:
        return []
    end = len(tokens)
    for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
        tail = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):  # NOTE: the latest match: the answer's own recent text first
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


def can_speculate(seq: Sequence) -> bool:
    p = seq.params
    return (
        not p.penalized
        and p.structured is None
        and p.logprobs is None
        and p.prompt_logprobs is None
        and p.n == 1
        and seq.grammar is None
    )


def room(seq: Sequence, k: int, block_size: int, max_model_len: int) -> int:
    """How many proposals `seq` may carry this step: at most `k`, within its max_tokens and the
    context, and never so many that they fill the KV block its last token is in."""
    tokens = seq.num_tokens
    return max(0, min(
        k,
        seq.params.max_tokens - seq.num_completion - 1,
        max_model_len - tokens - 1,
        block_size - 1 - tokens % block_size,
    ))  # fmt: skip


def accept(seq: Sequence, real: int) -> int:
    """After the verifying forward: `seq.tokens` back to its `real` tokens plus the proposals the
    model chose and the model's own next token; returns how many proposals were kept. The K/V of
    the kept ones are in the cache (`num_computed` counts them); the last token's are not yet."""
    proposals, chosen = seq.tokens[real : real + seq.draft], seq.verify
    kept = 0
    while kept < len(proposals) and chosen[kept] == proposals[kept]:
        kept += 1
    seq.tokens[real:] = [*proposals[:kept], chosen[kept]]
    seq.num_computed = real + kept
    seq.draft, seq.verify = 0, []
    return kept


def accept_sampled(seq: Sequence, real: int, generator: torch.Generator) -> int:
    """`accept` for a sampled sequence, from the model's distributions at the chunk's positions
    (`seq.verify_logits` [1 + k, vocab]): proposal i is kept with probability p_i(proposal); the
    first refused one is replaced by a draw from p_i without it; all kept, one more token is drawn
    from the last position's p. Returns how many proposals were kept."""
    proposals = seq.tokens[real : real + seq.draft]
    probs = filtered_probs(seq.verify_logits, [seq.params] * seq.verify_logits.shape[0])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    kept, chosen = 0, None
    for i, token in enumerate(proposals):
        if float(torch.rand((), generator=generator, device=probs.device)) < float(probs[i, token]):
            kept += 1
            continue
        rest = probs[i].clone()
        rest[token] = 0.0
        chosen = int(draw(rest, generator))
        break
    if chosen is None:
        chosen = int(draw(probs[len(proposals)], generator))
    seq.tokens[real:] = [*proposals[:kept], chosen]
    seq.num_computed = real + kept
    seq.draft, seq.verify, seq.verify_logits = 0, [], None
    return kept


class Speculation:
    """Per engine: proposes before a step, counts what verification kept, adapts k to the rate.
    `draft` (draft.py): a draft model proposes; else prompt lookup does."""

    def __init__(self, k: int, draft: DraftModel | None = None) -> None:
        self.k = k
        self.draft = draft
        self.proposed = self.accepted = 0
        self.rate = 1.0  # recent acceptance (exponential average): low, fewer proposals
        self.resting = 0  # steps left without proposals (the rate fell below LOW_RATE)

    def tokens_now(self) -> int:
        return max(1, round(self.k * min(1.0, self.rate + 0.25)))

    def may_propose(self, scheduler: Scheduler) -> bool:
        """Whether this step may carry proposals (the engine then runs it step by step); once a step,
        so a resting step counts down here."""
        if self.resting > 0:
            self.resting -= 1
            return False
        running = scheduler.running
        return len(running) <= MOST_SPECULATING and any(q.is_decode and can_speculate(q) for q in running)

    def propose(self, scheduler: Scheduler, block_size: int, max_model_len: int) -> list[Sequence]:
        """Proposals appended to the running sequences that may speculate, when the running
        sequences are few and all decode (so each verifying chunk is scheduled whole, before any
        admission); the sequences that got some."""
        running = scheduler.running
        if not 0 < len(running) <= MOST_SPECULATING or not all(q.is_decode for q in running):
            if self.draft is not None and len(running) > MOST_SPECULATING:
                self.draft.reset()  # NOTE: an admission's prefill keeps the running ones' shadows
            return []
        k, budget = self.tokens_now(), scheduler.max_num_batched_tokens - len(running)
        seqs, rooms = [], []
        for seq in running:
            if seq.draining or seq.tokens[-1] == PENDING or not can_speculate(seq):
                continue
            n = min(budget, room(seq, k, block_size, max_model_len))
            if n > 0:
                seqs.append(seq)
                rooms.append(n)
                budget -= n
        if self.draft is not None:
            proposed = self.draft.propose(seqs, rooms, keep=running)
        else:
            proposed = [propose(seq.tokens, n) for seq, n in zip(seqs, rooms, strict=True)]
        drafted = []
        for seq, proposals in zip(seqs, proposed, strict=True):
            if proposals:
                seq.tokens += proposals
                seq.draft = len(proposals)
                drafted.append(seq)
        return drafted

    def record(self, proposed: int, kept: int) -> None:
        self.proposed += proposed
        self.accepted += kept
        if proposed:
            self.rate = 0.8 * self.rate + 0.2 * (kept / proposed)
            if self.rate < LOW_RATE:
                self.resting = REST_STEPS


def drop_unverified(plan: StepPlan, drafted: list[Sequence]) -> None:
    """Proposals of a sequence the step does not verify whole (preempted, out of budget) are dropped."""
    whole = {id(c.seq) for c in plan.prefills if c.samples and c.seq.draft}
    for seq in drafted:
        if id(seq) not in whole:
            assert not any(c.seq is seq for c in plan.chunks), "a verifying chunk was cut"
            del seq.tokens[len(seq.tokens) - seq.draft :]
            seq.draft = 0
