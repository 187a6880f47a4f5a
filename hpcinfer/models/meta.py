"""Building a model's modules without memory or initialisation, for weights assigned right after.

`torch.device("meta")` alone allocates nothing, but each module still runs its initialiser, and
on the meta device `normal_` goes through torch's Python reference ops, whose first call imports
`torch._dynamo`: about 1 s of every run's start-up, spent on values that are thrown away.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_INITIALISED = (nn.Linear, nn.Embedding, nn.LayerNorm)


@contextmanager
def empty_modules() -> Iterator[None]:
    """Modules made inside are on the meta device and skip `reset_parameters`."""
    saved = {cls: cls.reset_parameters for cls in _INITIALISED}
    for cls in _INITIALISED:
        cls.reset_parameters = _skip  # type: ignore[method-assign]
    try:
        with torch.device("meta"):
            yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


def _skip(self: nn.Module) -> None:
    return None


__all__ = ["empty_modules"]
