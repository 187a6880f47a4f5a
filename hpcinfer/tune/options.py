"""What `hpcinfer tune` is asked beyond `run`'s options. Light on purpose: the command line reads
its defaults for `--help`, which imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass


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
    sample_seed: int = 0  # the sample draw's; --seed is the generation seed, as in `run`
    trials_csv: str | None = None
    recipe_path: str | None = None
    report_html: str | None = None
    report_json: str | None = None
