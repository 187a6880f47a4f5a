"""Building a model's modules without memory or initialisation, for weights assigned right after.

`torch.device("meta")` alone allocates nothing, but each module still runs its initialiser, and
on the meta device `normal_` goes through torch's Python reference ops, whose first call imports
`torch._dynamo`: about 1 s of every run's start-up, spent on values that are thrown away.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# each module class made here and the method its __init__ initialises its parameters with
_INITIALISED = (
    (nn.Linear, "reset_parameters"),
    (nn.Embedding, "reset_parameters"),
    (nn.LayerNorm, "reset_parameters"),
    (nn.Conv2d, "reset_parameters"),
    (nn.MultiheadAttention, "_reset_parameters"),
)

_PATCHING = threading.RLock()  # NOTE: reentrant: a loader may build a part inside another's


@contextmanager
def empty_modules() -> Iterator[None]:
    """Modules made inside are on the meta device and skip their initialisers.

    NOTE: the initialisers are class attributes, so one thread at a time patches them (a loader
    on another thread waits here), and one a class inherits (Conv2d's) is inherited again after.
    """
    with _PATCHING:
        saved = [(cls, name, cls.__dict__.get(name)) for cls, name in _INITIALISED]
        for cls, name in _INITIALISED:
            setattr(cls, name, _skip)
        try:
            with torch.device("meta"):
                yield
        finally:
            for cls, name, method in saved:
                if method is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, method)


def _skip(self: nn.Module) -> None:
    return None


__all__ = ["empty_modules"]
