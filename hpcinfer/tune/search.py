"""The tuning search: which configurations to try, in what order, and which one wins.

Pure logic over a `measure(params) -> Trial` callback, so it is tested without running a model.

One knob at a time, most important first: the token budget (coarse steps of x4 from the
default, then x2 around the best), then the row cap, then, where they mean something, streams
and staging buffers, and under `--rate` the batch timeout. In each direction the search keeps
going only while a step beats the best so far by at least `min_gain`; a change that gains less
is noise on a shared machine, so the default is kept unless something is measurably better.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KNOBS = ("max_batch_tokens", "max_batch_size", "streams", "staging_buffers", "batch_timeout_ms")


@dataclass(slots=True)
class Trial:
    params: dict[str, Any]
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0
    p99_ms: float = 0.0  # per batch, or per request under --rate
    memory_bytes: int = 0  # peak device memory on CUDA, peak RSS on CPU
    saturated: bool = False  # under --rate: the pipeline did not keep up
    status: str = "ok"  # ok | over-limit | infeasible
    note: str = ""
    repeats: int = 0
    index: int = 0
    gain: float | None = None  # objective against the default configuration (ratio)
    # Generation trials only (tokens_per_s is then generated tokens per second):
    ttft_ms: float = 0.0  # median over repeats of the p50 time to first token
    tpot_ms: float = 0.0  # likewise, time per output token after the first
    low: float = 0.0  # the objective of the slowest and the fastest repeat (0: as the median)
    high: float = 0.0
    spread: float = 0.0  # (high - low) / median: the noise the repeats showed
    cached_share: float = 0.0  # share of prompt tokens the prefix cache served


@dataclass(slots=True)
class Goal:
    """What to maximise and which trials are allowed."""

    objective: str = "rows"  # rows | tokens | latency (lowest per-request p99, under --rate)
    max_p99_ms: float | None = None
    max_memory_bytes: int | None = None
    min_gain: float = 0.05

    def score(self, t: Trial) -> float:
        """Higher is better; -inf for a trial that cannot be chosen."""
        if t.status != "ok":
            return -math.inf
        if self.objective == "latency":
            return -math.inf if t.saturated else -t.p99_ms
        return t.tokens_per_s if self.objective == "tokens" else t.rows_per_s

    def check(self, t: Trial) -> None:
        """Marks a measured trial over-limit when it breaks a constraint."""
        if t.status != "ok":
            return
        broken = []
        if self.max_p99_ms is not None and t.p99_ms > self.max_p99_ms:
            broken.append(f"p99 {t.p99_ms:,.1f} ms > {self.max_p99_ms:g} ms")
        if self.max_memory_bytes is not None and t.memory_bytes > self.max_memory_bytes:
            broken.append(f"memory {t.memory_bytes / 2**20:,.0f} MiB > {self.max_memory_bytes / 2**20:,.0f} MiB")
        if broken:
            t.status, t.note = "over-limit", "; ".join(broken)

    def beats(self, t: Trial, best: Trial) -> bool:
        """Better than `best` by at least min_gain (any feasible trial beats an infeasible best)."""
        new, old = self.score(t), self.score(best)
        if new == -math.inf:
            return False
        if old == -math.inf:
            return True
        if self.objective == "latency":  # scores are negative latencies
            return -new <= -old * (1 - self.min_gain)
        return new >= old * (1 + self.min_gain)

    def gain(self, t: Trial, default: Trial) -> float | None:
        new, old = self.score(t), self.score(default)
        if new == -math.inf or old == -math.inf or old == 0:
            return None
        return (-old) / (-new) if self.objective == "latency" else new / old


@dataclass(slots=True)
class Space:
    """The values each knob may take; a knob with one value is not swept."""

    token_min: int
    token_max: int
    batch_sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024)
    streams: tuple[int, ...] = (1,)
    staging_buffers: tuple[int, ...] = (2,)
    timeouts_ms: tuple[float, ...] = ()
    skipped: list[str] = field(default_factory=list)  # knobs left out, with the reason
    min_row_tokens: int = 1  # the shortest padded row of the sample

    def canonical(self, params: dict[str, Any]) -> tuple:
        """Parameters that plan the very same batches map to the same key: a row cap above
        budget / shortest row never binds, so trying it would measure the same thing again."""
        values = dict(params)
        if "max_batch_size" in values and "max_batch_tokens" in values:
            most_rows = max(1, values["max_batch_tokens"] // self.min_row_tokens)
            values["max_batch_size"] = min(values["max_batch_size"], most_rows)
        return tuple(values[k] for k in KNOBS if k in values)

    def tokens(self) -> list[int]:
        """Powers of two within [token_min, token_max]."""
        lo = 1 << max(0, math.ceil(math.log2(self.token_min)))
        values = []
        while lo <= self.token_max:
            values.append(lo)
            lo *= 2
        return values


class Search:
    def __init__(
        self,
        measure: Callable[[dict[str, Any]], Trial],
        goal: Goal,
        space: Space,
        on_trial: Callable[[Trial], None] | None = None,
    ) -> None:
        self._measure = measure
        self.on_trial = on_trial
        self.goal = goal
        self.space = space
        self.trials: list[Trial] = []
        self._seen: dict[tuple, Trial] = {}
        self.default: Trial | None = None
        self.best: Trial | None = None
        self.view: Any = None  # the task's table, log line and verdict (tasks/<task>/tune_view.py)

    def run(self, default: dict[str, Any]) -> Trial:
        self.default = self.best = self.measure(default)
        self.default.gain = self.goal.gain(self.default, self.default)
        self._sweep("max_batch_tokens", self.space.tokens(), coarse=2)
        self._sweep("max_batch_size", list(self.space.batch_sizes))
        self._sweep("streams", list(self.space.streams))
        self._sweep("staging_buffers", list(self.space.staging_buffers))
        if self.space.timeouts_ms:
            self._sweep("batch_timeout_ms", list(self.space.timeouts_ms))
        return self.best

    def measure(self, params: dict[str, Any]) -> Trial:
        key = self.space.canonical(params)
        if key in self._seen:
            return self._seen[key]
        trial = self._measure(dict(params))
        trial.index = len(self.trials)
        self.goal.check(trial)
        if self.default is not None:
            trial.gain = self.goal.gain(trial, self.default)
        self.trials.append(trial)
        self._seen[key] = trial
        if self.on_trial is not None:
            self.on_trial(trial)
        return trial

    def _sweep(self, knob: str, values: list[Any], coarse: int = 1) -> None:
        """Walks up and down from the best value of `knob`, `coarse` grid steps at a time, then
        refines one step either side of the winner; each walk stops at the first step that does
        not beat the best by min_gain."""
        assert self.best is not None
        values = self._distinct(knob, values)
        if len(values) < 2:
            return
        for step in dict.fromkeys((coarse, 1)):  # coarse steps, then one-step refinement
            start = values.index(self.best.params[knob])
            for direction in (+1, -1):
                i = start + direction * step
                while 0 <= i < len(values):
                    trial = self.measure({**self.best.params, knob: values[i]})
                    if not self.goal.beats(trial, self.best):
                        break
                    self.best = trial
                    i += direction * step
                if self.best.params[knob] != values[start]:
                    break  # found a better value going up: no need to walk down from the old one

    def _distinct(self, knob: str, values: list[Any]) -> list[Any]:
        """The values of `knob` that plan different batches from the best's and from each other,
        sorted: the best's own value stands for every value equivalent to it (a row cap that never
        binds), so a walk never steps onto a repeat of the best and stops short of what lies beyond."""
        assert self.best is not None
        params = self.best.params
        seen = {self.space.canonical(params)}
        out = [params[knob]]
        for value in sorted(values):
            key = self.space.canonical({**params, knob: value})
            if key not in seen:
                seen.add(key)
                out.append(value)
        return sorted(out)


def brief(params: dict[str, Any]) -> str:
    """A trial's knobs in one line, as flags: max-batch-tokens=4096, prefix-cache=off."""
    return ", ".join(f"{k.replace('_', '-')}={_shown(v)}" for k, v in params.items())


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


OnSample = Callable[[Any], None] | None  # shown the drawn sample
OnTrial = Callable[["Search", Trial | None, str], None] | None  # shown each finished trial, or a status
