"""What `hpcinfer tune` is asked (its own options) and what it answers (the sample, the search, the goal)."""

from __future__ import annotations

from dataclasses import dataclass

from .gen_trial import RequestSample
from .sample import Sample
from .search import Goal, Search, Trial


@dataclass(slots=True)
class TuneOptions:
    sample_rows: int | None = None  # None: 2000 rows to embed, 512 requests to generate
    scan_rows: int = 50_000
    repeats: int = 3
    warmup_rows: int | None = None  # None: 200 rows to embed, 32 (short answers) to generate
    objective: str | None = None  # None: rows (tokens to generate), or latency under --rate
    max_p99_ms: float | None = None
    max_memory: str | None = None
    min_gain: float = 0.05
    seed: int = 0
    trials_csv: str | None = None
    recipe_path: str | None = None


@dataclass(slots=True)
class TuneResult:
    sample: Sample | RequestSample
    search: Search  # a GenerationSearch for a causal LM
    device: str
    goal: Goal

    @property
    def best(self) -> Trial:
        assert self.search.best is not None
        return self.search.best

    @property
    def default(self) -> Trial:
        assert self.search.default is not None
        return self.search.default
