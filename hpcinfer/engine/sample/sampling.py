"""Batched sampling: logits [S, vocab] and each row's SamplingParams -> one token id per row.

Greedy rows take the argmax. Sampling rows are filtered together (temperature, top-k, top-p,
min-p on the batch) and then drawn (an exponential race, `draw`) with each request's own
generator, so a seeded request gets the same tokens whichever requests share its batch. A request
without a seed gets one derived from the run's seed and its sequence id: results are still
reproducible (and resumable).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from ..sequence import SamplingParams, Sequence


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.seed = seed
        self._generators: dict[tuple[int, int], torch.Generator] = {}

    def generator_of(self, seq: Sequence) -> torch.Generator:
        """The sequence's own generator (its seed, or the run's and its id): speculation draws from it too."""
        return self._generator(seq)

    def _generator(self, seq: Sequence) -> torch.Generator:
        key = (seq.seq_id, seq.sample_index)
        gen = self._generators.get(key)
        if gen is None:
            seed = seq.params.seed if seq.params.seed is not None else self.seed * 1_000_003 + seq.seq_id
            gen = torch.Generator(device=self.device).manual_seed(sample_seed(seed, seq.sample_index))
            self._generators[key] = gen
        return gen

    def release(self, seq: Sequence) -> None:
        """Forgets a finished sequence's generator."""
        self._generators.pop((seq.seq_id, seq.sample_index), None)

    def sample(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """logits [S, vocab] float32, one row per sequence in `seqs` -> S token ids."""
        return self.sample_on_device(logits, seqs).tolist()

    def sample_on_device(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """The S token ids as a tensor on the logits' device, without waiting for them (greedy rows).

        NOTE: rows that draw still wait on the device now and then (a top-k/top-p row's bound,
        parameters copied up): a step ahead keeps its overlap for greedy rows."""
        tokens = greedy(logits)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            choices = candidates(logits.index_select(0, rows), [seqs[i].params for i in random_rows])
            for i, (weights, ids) in zip(random_rows, choices, strict=True):
                # One draw from this row's own generator: the result never depends on the batch.
                pick = draw(weights, self._generator(seqs[i]))
                tokens[i] = pick if ids is None else ids[pick]
        return tokens


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, vocab] -> [S]: each row's largest, the first of equals (as argmax: NaN wins too).

    NOTE: `max(dim).indices`, not `argmax`: on the CPU argmax ran 3x slower on a step's logits
    (128 x 30,522 float32: 3.0 ms against 1.0 ms, Intel Xeon family 6 model 167, 2 threads),
    for the same indices."""
    return logits.max(dim=-1).indices


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (n samples): sample 0 keeps the seed,
    so it is the answer the request would get with n = 1; sample i is the answer of the same request
    with n = 1 and this seed. NOTE: it depends on the request alone, never on its neighbours or on
    a resume."""
    if index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 63)


RACE_BLOCK = 256  # a full vocabulary races in blocks: one arrival per block, then one per token of the winner


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index drawn with probability proportional to `weights` [K]: an exponential race.

    Each candidate i waits an exponential time E_i / w_i and the first to arrive wins, i.e.
    argmax(w_i / E_i), which picks i with probability w_i / sum(w). NOTE: inverting the CDF would
    need one uniform only, but a run's logits differ in their last bits with the batch a row
    shares (matmul blocking); with the CDF every one of the K boundaries can move, so a flat
    distribution flips a token with probability ~K times that noise, and a resumed run would not
    write what the uninterrupted one did. The race flips only when the two best arrivals are
    within the noise of each other.

    A long list races in two rounds, which is still exact: a block of RACE_BLOCK candidates wins
    with probability (its weight sum) / sum(w), then one of its candidates with (its weight) /
    (the block's sum). So a 49k vocabulary costs ~450 arrivals instead of 49k (on a CPU 49k
    random draws take ~5x as long as the CDF; these take about as long).
    """
    if weights.numel() <= 2 * RACE_BLOCK:
        return _race(weights, generator)
    blocks = torch.nn.functional.pad(weights, (0, -weights.numel() % RACE_BLOCK)).view(-1, RACE_BLOCK)
    block = _race(blocks.sum(dim=1), generator)
    return block * RACE_BLOCK + _race(blocks[block], generator)


def _race(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """argmax(w / E), E ~ Exp(1) drawn as -log(U): a zero weight never wins (E is kept above 0,
    since 0 / 0 would be NaN, which argmax takes as the largest)."""
    arrivals = torch.rand(weights.shape, generator=generator, device=weights.device, dtype=weights.dtype)
    arrivals = arrivals.log_().neg_().clamp_min_(torch.finfo(weights.dtype).tiny)
    return (weights / arrivals).argmax()


def candidates(logits: torch.Tensor, params: Seq[SamplingParams]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per row, the tokens it may draw and their weights: (weights [K], token ids [K]) or (weights [vocab], None).

    NOTE: a top-k / top-p row keeps a short list (`topk` of CANDIDATES), so a step does not sort
    the whole vocabulary for every sampled row; a row whose nucleus reaches past the list (a flat
    distribution), or that has neither filter, takes the full vocabulary (`filtered_probs`). Which
    way a row goes depends on that row alone, so its draws never depend on its neighbours.
    """
    vocab = logits.shape[-1]
    out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(params)
    short = [j for j, p in enumerate(params) if (p.top_k or p.top_p < 1) and p.top_k < vocab]
    if short:
        weights, ids, bounded = _short_lists(logits[short], [params[j] for j in short])
        for r, j in enumerate(short):
            if bounded[r]:
                out[j] = (weights[r], ids[r])
    full = [j for j, o in enumerate(out) if o is None]
    if full:
        probs = filtered_probs(logits[full], [params[j] for j in full])
        for r, j in enumerate(full):
            out[j] = (probs[r], None)
    return out  # type: ignore[return-value]


def _short_lists(logits: torch.Tensor, params: Seq[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Top-k / top-p / min-p over each row's largest probabilities; `bounded` False where that is not enough."""
    dev, vocab = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    probs = (logits / temp[:, None]).softmax(dim=-1)
    vals, ids = probs.topk(min(vocab, max(CANDIDATES, *(p.top_k for p in params))), dim=-1)  # largest first
    top_k = torch.tensor([p.top_k or vals.shape[-1] for p in params], device=dev)
    vals = vals.masked_fill(torch.arange(vals.shape[-1], device=dev)[None, :] >= top_k[:, None], 0.0)
    # top-p over what top-k left, renormalised: over the whole vocabulary when top-k is off
    no_top_k = torch.tensor([p.top_k == 0 for p in params], device=dev)
    mass = torch.where(no_top_k, 1.0, vals.sum(dim=-1))
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=vals.dtype)
    before = vals.cumsum(dim=-1) - vals
    bounded = ~(no_top_k & (before[:, -1] + vals[:, -1] < top_p))
    vals = vals.masked_fill(before >= top_p[:, None] * mass[:, None], 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=vals.dtype)
    vals = vals.masked_fill(vals < min_p[:, None] * vals[:, :1], 0.0)
    return vals, ids, bounded.tolist()


CANDIDATES = 256


def filtered_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, batched: [S, vocab] logits -> probabilities."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temp[:, None]
    if any(p.top_k or p.top_p < 1 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)
        sorted_logits = sorted_logits.masked_fill(
            torch.arange(vocab, device=dev)[None, :] >= top_k[:, None], float("-inf")
        )
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
        sorted_probs = sorted_logits.softmax(dim=-1)  # top-p over what top-k left, renormalised
        # keep a token while the mass before it is < top_p (so the first token always stays)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=probs.dtype)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
