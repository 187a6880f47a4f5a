"""A device's fault: what failed on which of the run's devices, as its circuit breaker counts it.

One record for every engine: the encoder pipeline's classifier (pipeline/faults.py) and the
generation engines' step rule (engine/runtime/devices.py) both give one, locally and on Ray.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceFault:
    device: int  # index into the run's devices (a Ray replica's own: 0)
    error: str  # "Type: message", as the report and the final error show it
    hung: bool = False  # nothing done within --step-timeout: opened at once, not counted
    dropped: tuple[int, ...] = ()  # a generation engine's sequences it dropped: their prompts run elsewhere


def fault_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
