"""The tuning sample: N rows of the user's own input, stratified over token length.

Batch shapes depend on the length mix, so the sample must keep it: rows are ordered by token
length, cut into N equal strata and one row is drawn from each (seeded), then put back in input
order. A sample taken from the head of a file would miss a length mix that drifts along it, so
up to `scan_rows` rows are read first. What a task samples is its own (pipeline/tuning.py,
tasks/generate/tune_trial.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class Sample:
    path: Path
    rows: int
    scanned: int
    lengths: np.ndarray  # token lengths of the sampled rows
    scanned_lengths: np.ndarray

    def describe(self) -> str:
        def pct(a: np.ndarray) -> str:
            return "/".join(str(int(v)) for v in np.percentile(a, [10, 50, 90]))

        return (
            f"{self.rows:,} of {self.scanned:,} rows, stratified over token length "
            f"(p10/p50/p90: {pct(self.lengths)} tokens; scanned rows: {pct(self.scanned_lengths)})"
        )


def stratified_indices(lengths: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Indices of n rows, one from each of n equal strata of the length-sorted rows, in input order."""
    total = len(lengths)
    if n >= total:
        return np.arange(total)
    order = np.argsort(lengths, kind="stable")
    rng = np.random.default_rng(seed)
    picks = ((np.arange(n) + rng.random(n)) * total / n).astype(np.int64)
    return np.sort(order[np.minimum(picks, total - 1)])
