"""The tuning search for a causal LM: engine budgets, then prefix caching on or off.

Pure logic over a `measure(params) -> Trial` callback, as `search.py`, whose one-knob sweep it
reuses. The knobs: `max_num_seqs` (how wide a decode step is: the main throughput lever), then
`max_num_batched_tokens` (how much prefill rides along with the decodes), then `max_num_seqs`
once more around the best if the token budget moved (the two interact), and last prefix caching
off at the best point, kept off only where that is measurably faster (`keeps_prefix_cache`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...tune.search import Goal, Search, Trial

GEN_KNOBS = ("max_num_batched_tokens", "max_num_seqs", "prefix_cache")


def powers_of_two(lo: int, hi: int) -> list[int]:
    """Powers of two within [lo, hi] (none when hi < lo)."""
    value, out = 1 << max(0, math.ceil(math.log2(max(lo, 1)))), []
    while value <= hi:
        out.append(value)
        value *= 2
    return out


@dataclass(slots=True)
class GenerationSpace:
    """The values each engine budget may take, sized by the sample and the KV pool."""

    rows: int  # sampled rows: more sequences than this never run at once
    step_tokens: int  # prompt + max_tokens over the whole sample: no step can hold more
    seqs: tuple[int, ...]
    tokens: tuple[int, ...]
    skipped: list[str] = field(default_factory=list)  # what is left out, with the reason
    timeouts_ms: tuple[float, ...] = ()  # no batch timeout in generation

    def canonical(self, params: dict[str, Any]) -> tuple:
        """Budgets that cannot bind on this sample plan the very same steps: measure them once."""
        return (
            min(params["max_num_batched_tokens"], self.step_tokens),
            min(params["max_num_seqs"], self.rows),
            params["prefix_cache"],
        )

    @property
    def most_trials(self) -> int:
        """An upper bound on the trials `GenerationSearch.run` makes: the default, each value of
        both sweeps, the second `max_num_seqs` sweep, and prefix caching off."""
        return 1 + len(self.tokens) + 2 * len(self.seqs) + 1


def generation_space(rows: int, step_tokens: int, fit_rows: int, token_lo: int, token_hi: int) -> GenerationSpace:
    """`fit_rows`: about how many sampled rows the KV pool holds at once.

    `max_num_seqs` goes up to half the sample (with fewer than two rounds of sequences a trial
    measures the ramp-down more than the steady state) and to twice what the KV pool holds (past
    that, sequences are admitted only to be preempted). Token budgets go from `token_lo` (256,
    or the longest prompt without chunked prefill) to `token_hi` (the device's sensible most),
    and stop at the first one that holds the whole sample.
    """
    seq_hi = max(1, min(rows // 2, 2 * fit_rows))
    seqs = powers_of_two(min(4, seq_hi), seq_hi)
    tokens = [t for t in powers_of_two(token_lo, token_hi) if t < step_tokens]
    tokens += [t for t in powers_of_two(step_tokens, token_hi)[:1] if t >= token_lo]
    if 2 * fit_rows < rows // 2:
        reason = f"the KV pool holds about {fit_rows} of these rows at once (--kv-cache-memory)"
    else:
        reason = f"the sample has {rows} rows (--sample to go higher)"
    return GenerationSpace(
        rows, step_tokens, tuple(seqs), tuple(tokens or [token_lo]), [f"max-num-seqs above {seq_hi}: {reason}"]
    )


def beats_every_repeat(goal: Goal, t: Trial, best: Trial) -> bool:
    """`t`'s slowest repeat beats `best`'s fastest by --min-gain (a feasible trial beats an infeasible one).

    NOTE: a generation pass is one long run, not many batches, and on a shared machine two passes
    of one configuration can differ by more than --min-gain; comparing medians alone would take
    noise for a gain. With one repeat each (or tight repeats) this is the plain --min-gain rule.
    """
    new, old = goal.score(t), goal.score(best)
    if new == -math.inf:
        return False
    if old == -math.inf:
        return True
    return (t.low or new) >= (best.high or old) * (1 + goal.min_gain)


@dataclass(slots=True)
class NoisyGoal(Goal):
    """A `Goal` whose sweep steps must beat the best in every repeat (`beats_every_repeat`)."""

    def beats(self, t: Trial, best: Trial) -> bool:
        return beats_every_repeat(self, t, best)


def keeps_prefix_cache(on: Trial, off: Trial, goal: Goal) -> bool:
    """Prefix caching stays on unless turning it off is faster beyond the noise.

    NOTE: "faster beyond the noise" is `beats_every_repeat`: off's slowest repeat beats on's
    fastest by --min-gain. On a sample without shared prefixes the two measure the same up to
    that noise (the cache then costs only block hashing), and the sample thins out the rows that
    share a prefix in the whole input, so the cache "helps" unless it is measurably slower: it
    is turned off only where it measurably costs throughput.
    """
    return not beats_every_repeat(goal, off, on)


class GenerationSearch(Search):
    """`Search` over the engine budgets; `prefix_on` and `prefix_off` are the two trials compared."""

    def __init__(
        self,
        measure: Callable[[dict[str, Any]], Trial],
        goal: Goal,
        space: GenerationSpace,
        on_trial: Callable[[Trial], None] | None = None,
    ) -> None:
        super().__init__(measure, goal, space, on_trial)  # type: ignore[arg-type]
        self.space: GenerationSpace = space  # type: ignore[assignment]
        self.prefix_on: Trial | None = None
        self.prefix_off: Trial | None = None

    def run(self, default: dict[str, Any]) -> Trial:
        self.default = self.best = self.measure(default)
        self.default.gain = self.goal.gain(self.default, self.default)
        self._sweep("max_num_seqs", list(self.space.seqs), coarse=2)
        before = self.best
        self._sweep("max_num_batched_tokens", list(self.space.tokens), coarse=2)
        if self.best is not before:
            self._sweep("max_num_seqs", list(self.space.seqs))
        self.prefix_on = self.best
        self.prefix_off = self.measure({**self.best.params, "prefix_cache": not self.best.params["prefix_cache"]})
        on, off = (self.best, self.prefix_off) if self.best.params["prefix_cache"] else (self.prefix_off, self.best)
        self.best = on if keeps_prefix_cache(on, off, self.goal) else off
        return self.best


def prefix_line(search: GenerationSearch) -> str:
    """Why prefix caching is on or off, with both measurements."""
    on, off, goal = search.prefix_on, search.prefix_off, search.goal
    assert on is not None and off is not None and search.best is not None
    if not on.params["prefix_cache"]:
        on, off = off, on
    state = "on" if search.best.params["prefix_cache"] else "off"
    served = f"served {on.cached_share:.0%} of prompt tokens"
    if on.status != "ok" or off.status != "ok":
        return f"prefix cache: {state} ({served}; the other setting did not finish)"
    ratio = goal.score(off) / goal.score(on) if goal.score(on) > 0 else float("inf")
    if state == "off":
        why = f"faster in every repeat by {goal.min_gain:.0%} or more"
    else:
        why = "slower" if ratio < 1 else f"not faster in every repeat by {goal.min_gain:.0%}"
    return f"prefix cache: {state} ({served}; off ran at {ratio:.2f}x on, {why})"
