"""Penalties on a step's logits, before greedy or sampled choice, batched on the device.

For the rows whose requests set any (`SamplingParams.penalized`), one [rows, vocab] count of the
tokens each has seen is built with one scatter (the answer's tokens for the OpenAI penalties,
prompt and answer for the repetition penalty), and only where a row needs it; then, on a copy of
those rows of the logits:
- `repetition_penalty` p (transformers' rule): a token in the prompt or answer has its logit
  divided by p when positive, multiplied by p when negative;
- `frequency_penalty` f and `presence_penalty` r (OpenAI's): logit - f * count - r * (count > 0),
  over the answer's tokens;
- `logit_bias`: added to the named tokens' logits;
- `allowed_token_ids`: every other token's logit is -inf;
- `bad_words` (vLLM's rule, on token ids): a word of one token is never chosen; the last token of a
  longer one is barred right after the answer's last tokens spelled the rest of it;
- `min_tokens`: EOS and the request's stop token ids are barred until the answer is that long.
A step ahead the answer's last token may still be on the device (PENDING on the host): its count
comes from the in-flight tokens, on the device, so nothing waits for it.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq

import torch

from ..sequence import PENDING, Sequence
from ..staging import InFlightTokens


def penalize(
    logits: torch.Tensor, seqs: Seq[Sequence], eos: Collection[int], ahead: InFlightTokens | None = None
) -> torch.Tensor:
    """logits [S, vocab] float32, one row per sequence of `seqs`; returns them with penalties applied."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    picked = [seqs[i] for i in rows]
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in picked], device=device, dtype=sub.dtype)[:, None]

    if any(s.params.repetition_penalty != 1.0 for s in picked):
        seen = _counts(picked, vocab, device, ahead, answer_only=False) > 0
        p = per_row("repetition_penalty")
        sub = torch.where(seen, torch.where(sub > 0, sub / p, sub * p), sub)
    if any(s.params.frequency_penalty or s.params.presence_penalty for s in picked):
        answer = _counts(picked, vocab, device, ahead, answer_only=True)
        sub = sub - per_row("frequency_penalty") * answer - per_row("presence_penalty") * (answer > 0).to(sub.dtype)
    for k, seq in enumerate(picked):
        params = seq.params
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
            sub[k].index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], device=device, dtype=sub.dtype))
        if params.allowed_token_ids:
            barred = torch.full((vocab,), -torch.inf, device=device, dtype=sub.dtype)
            barred[torch.tensor(params.allowed_token_ids, device=device)] = 0.0
            sub[k] += barred
        if params.bad_words:
            _bar_bad_words(sub, k, seq, ahead)
        if seq.num_completion < params.min_tokens:
            ends = (*(() if params.ignore_eos else eos), *params.stop_token_ids)
            barred = [t for t in ends if 0 <= t < vocab]
            if barred:
                sub[k, torch.tensor(barred, device=device)] = -torch.inf
    return logits.index_copy(0, index, sub)  # NOTE: out of place: the runner's logits may be inference tensors


def _bar_bad_words(sub: torch.Tensor, k: int, seq: Sequence, ahead: InFlightTokens | None) -> None:
    """Row `k` of `sub`: each bad word's last token barred where choosing it would complete the word.
    A step ahead the answer's last token may be on the device: the comparison with it runs there."""
    vocab, answer = sub.shape[1], seq.tokens[seq.num_prompt :]
    for word in seq.params.bad_words:
        *head, last = word
        if last >= vocab or len(answer) < len(head):
            continue
        tail = answer[len(answer) - len(head) :] if head else []
        if tail and tail[-1] == PENDING and ahead is not None:
            if tail[:-1] != head[:-1]:
                continue
            pending = ahead.tokens[ahead.index_of(seq, len(seq.tokens) - 1)]
            sub[k, last] = torch.where(pending == head[-1], -torch.inf, sub[k, last])
        elif tail == head:
            sub[k, last] = -torch.inf


def _counts(
    seqs: Seq[Sequence], vocab: int, device: torch.device, ahead: InFlightTokens | None, answer_only: bool
) -> torch.Tensor:
    """[len(seqs), vocab] float counts of each sequence's tokens (its answer's, or all of them)."""
    known = [[t for t in (s.tokens[s.num_prompt :] if answer_only else s.tokens) if t != PENDING] for s in seqs]
    width = max((len(k) for k in known), default=0)
    ids = torch.full((len(seqs), width + 1), vocab, dtype=torch.long)  # `vocab` is a column thrown away
    for k, tokens in enumerate(known):
        ids[k, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    ids = ids.to(device, non_blocking=True)
    if ahead is not None:  # NOTE: the token still on its way, read from the device
        pending = [(k, ahead.index_of(s, s.tokens.index(PENDING))) for k, s in enumerate(seqs) if PENDING in s.tokens]
        if pending:
            rows = torch.tensor([k for k, _ in pending], device=device)
            cols = torch.tensor([j for _, j in pending], device=device)
            ids[rows, -1] = ahead.tokens.index_select(0, cols).long()
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


__all__ = ["penalize"]
