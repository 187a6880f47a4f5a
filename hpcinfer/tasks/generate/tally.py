"""What finished sequences add up to, wherever they finish: the local job, a Ray replica's unit, a
tuning pass. One rule for every count (rows, prompt, cached and generated tokens, finish reasons)
and every latency (time to first token, time per output token, read to finished per priority).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...engine.sequence import Sequence


@dataclass(slots=True)
class SequenceTally:
    rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0  # every sample's (n > 1: all n answers)
    cached_tokens: int = 0  # prompt tokens the prefix cache held
    finish_reasons: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)  # seconds: admitted -> first token
    tpot: list[float] = field(default_factory=list)  # seconds per output token after the first
    latency: dict[int, list[float]] = field(default_factory=dict)  # per priority: read (or arrived) -> finished

    def add(self, seq: Sequence, read_s: float | None = None) -> None:
        """A finished sequence; `read_s` (perf_counter seconds): when its row was read, for its latency."""
        self.rows += 1
        self.prompt_tokens += seq.num_prompt
        self.completion_tokens += seq.answer_tokens
        self.cached_tokens += seq.num_cached
        for sample in seq.all_samples:
            self.finish_reasons[sample.finish_reason] = self.finish_reasons.get(sample.finish_reason, 0) + 1
        self.ttft.append(seq.first_token_s - seq.arrival_s)
        if seq.num_completion > 1:
            self.tpot.append((seq.finish_s - seq.first_token_s) / (seq.num_completion - 1))
        if read_s is not None:
            self.latency.setdefault(seq.priority, []).append(seq.done_s - read_s)

    def figures(self) -> dict[str, Any]:
        """The counts under the names a report and a Ray unit's figures give them."""
        return {
            "rows": self.rows,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_cached": self.cached_tokens,
            "finish_reasons": dict(self.finish_reasons),
        }
