"""n samples of one prompt: the prompt is prefilled once, then the request forks.

When a request with n > 1 draws its first token, `fork_samples` makes its n - 1 other samples:
each shares the prompt's full KV blocks by reference count and gets its own copy of the last,
partly filled block (copy-on-write), joins the running list, and draws its first token from the
same logits row. From then on a sample is a sequence like any other (its own generator, seeded
from the request's seed and its index: `sampling.sample_seed`). The request is done, and handed
on as its first sample with all of them in `samples`, when its last sample finishes
(`request_done`).
"""

from __future__ import annotations

from ..constrained.structured import Grammars
from ..kvcache.pools import KVCache
from ..scheduler import Scheduler
from ..sequence import Sequence, Status


def fork_samples(
    sampling: list[Sequence], scheduler: Scheduler, cache: KVCache, grammars: Grammars | None
) -> list[int] | None:
    """Forks the samples of each request in `sampling` that draws its first token in this step
    (called once the step's forward has run: the prompt's K/V are written).

    The forks join `sampling` (and the running list) after the step's own rows; returns the logits
    row each row of `sampling` draws from (None: one each, no fork). NOTE: where the pool cannot
    give the forks their last blocks now, they queue as prompts of their own (prefilled again,
    their full blocks likely cached); their answers are the same.
    """
    due = [(row, seq) for row, seq in enumerate(sampling) if seq.forks_due]
    if not due:
        return None
    blocks = scheduler.blocks
    rows, copies = list(range(len(sampling))), []
    for row, seq in due:
        seq.samples = [seq]
        computed = seq.num_prompt  # NOTE: the step's own progress is recorded after sampling (advance)
        forkable = blocks.can_fork(seq, computed, seq.params.n - 1)
        for index in range(1, seq.params.n):
            child = Sequence(seq.seq_id, seq.tokens[: seq.num_prompt], seq.params, seq.tag, priority=seq.priority)
            child.sample_index, child.parent, child.arrival_s = index, seq, seq.arrival_s
            if seq.params.structured is not None and grammars is not None:
                child.grammar = grammars.matcher(seq.params.structured)  # its own matcher, at the start
            seq.samples.append(child)
            if not forkable:
                scheduler.add(child)
                continue
            copies += blocks.fork(seq, child, computed)
            child.num_computed = computed
            child.status = Status.RUNNING
            scheduler.running.append(child)
            sampling.append(child)
            rows.append(row)
    if copies:
        cache.copy_blocks(copies)
    return rows


def request_done(seq: Sequence) -> Sequence | None:
    """The request a finished `seq` answers, once every one of its samples has finished (its first
    sample, whose `samples` hold them all); None while some still run."""
    first = seq.parent or seq
    if first.samples is None or all(s.status is Status.FINISHED for s in first.samples):
        return first
    return None


__all__ = ["fork_samples", "request_done"]
