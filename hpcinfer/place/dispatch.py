"""Which replica (device) runs a batch: the one with the fewest outstanding tokens.

Outstanding tokens are a replica's queued and in-flight work, padding counted (rows x padded
length): a batch adds its tokens when it is sent and removes them when its results are written.
Equal rows are not equal work, and devices need not be equally fast: a faster device drains its
count sooner and so is chosen more often.

NOTE: counting alone splits the first batches of a run evenly (every count starts at zero, and
the longest batches come first), and a short run never recovers from that on devices of unequal
speed. So the count is weighed by each device's measured speed once it has finished work: a
batch goes where it would be done soonest, (outstanding + its tokens) / tokens per second of
that device's compute. Equal devices see no difference. `round_robin` is the naive rule, kept for
comparison. Pure Python, thread-safe; no torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

POLICIES = ("tokens", "round_robin")


@dataclass(slots=True)
class ReplicaLoad:
    outstanding: int = 0  # tokens sent and not yet written
    sent_tokens: int = 0
    sent_batches: int = 0
    sent_rows: int = 0
    done_tokens: int = 0  # finished, with the device time they took
    done_seconds: float = 0.0

    def rate(self, default: float) -> float:
        """Tokens per second of device time; `default` until enough is known."""
        return self.done_tokens / self.done_seconds if self.done_seconds > 0 else default


class Dispatcher:
    """choose(tokens) -> replica index (and counts the tokens); done(replica, tokens) when written."""

    def __init__(self, replicas: int, policy: str = "tokens") -> None:
        if replicas < 1:
            raise ValueError("at least one replica")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.policy = policy
        self.loads = [ReplicaLoad() for _ in range(replicas)]
        self._next = 0
        self._lock = threading.Lock()

    def choose(self, tokens: int, rows: int = 0) -> int:
        with self._lock:
            if self.policy == "round_robin":
                replica = self._next
                self._next = (self._next + 1) % len(self.loads)
            else:
                loads = self.loads
                rates = [load.rate(0.0) for load in loads]
                replica = soonest(
                    [load.outstanding for load in loads], rates, [load.sent_batches > 0 for load in loads], tokens
                )
            load = self.loads[replica]
            load.outstanding += tokens
            load.sent_tokens += tokens
            load.sent_batches += 1
            load.sent_rows += rows
            return replica

    def done(self, replica: int, tokens: int, device_seconds: float = 0.0) -> None:
        """The batch's results are written; `device_seconds` is how long the device computed it."""
        with self._lock:
            load = self.loads[replica]
            load.outstanding -= tokens
            if device_seconds > 0:
                load.done_tokens += tokens
                load.done_seconds += device_seconds

    def token_shares(self) -> list[float]:
        total = sum(load.sent_tokens for load in self.loads)
        return [load.sent_tokens / total if total else 0.0 for load in self.loads]


def soonest(
    outstanding: list[int], rates: list[float], tried: list[bool], tokens: int, held: dict[int, int] | None = None
) -> int:
    """The rule of every dispatch, batches and prompts alike: the replica that would finish `tokens` soonest.

    `outstanding[i]` tokens are queued on replica i, which computes `rates[i]` tokens a second (0:
    not measured yet, taken as the mean of the measured ones). `held[i]` of the new work's tokens
    replica i already holds (a cached prompt prefix). A replica not yet `tried` comes first, so
    each gets measured; ties go to the lowest index.
    """
    held = held or {}
    known = [r for r in rates if r > 0]
    default = sum(known) / len(known) if known else 1.0

    def finish_estimate(i: int) -> tuple[bool, float]:
        return tried[i], (outstanding[i] + tokens - held.get(i, 0)) / (rates[i] or default)

    return min(range(len(rates)), key=finish_estimate)
