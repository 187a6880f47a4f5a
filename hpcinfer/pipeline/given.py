"""What an embedding run is given (`RunExtras`, besides its config) and what its start-up settled
(`EmbedJob`): plain records, shared by the job, its run and its degrading restarts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RunConfig
from ..device import Device
from ..files.parts import PartStore
from ..models.checkpoint import CheckpointInfo
from ..models.registry import LoadedModel
from ..obs.profile import RangeBackend
from ..obs.progress import Progress
from ..obs.timing import Span
from .read import Reader


@dataclass(frozen=True, slots=True)
class RunExtras:
    """What a caller adds to an embedding run besides its config (see `api.run`)."""

    progress: Progress | None = None
    hooks: dict[str, Callable[[Any], None]] | None = None  # stage name -> called before each item (tests)
    ranges: RangeBackend | None = None  # a profiler range per work item (hpcinfer profile)
    batch_profiler: Any = None  # torch.profiler over a few batches
    model: LoadedModel | None = None  # loaded already for the (first) device and dtype
    trace_marks: list[Span] = field(default_factory=list)  # instants the trace shows besides the stages (breakers)
    quantize: dict[str, Any] = field(default_factory=dict)  # --quantize int8|auto: the check that chose the model
    stop: Any = None  # a threading.Event the caller may set to stop the run (api.run's `stop`)
    shelf: Any = None  # a models.shelf.ModelShelf: models kept loaded between runs (api.run's `shelf`)


@dataclass(frozen=True, slots=True)
class EmbedJob:
    """What start-up settled: the run's config, device, output store, reader and model facts."""

    config: RunConfig
    devices: list[Device]  # one replica each
    store: PartStore
    reader: Reader
    info: CheckpointInfo
    max_length: int
    dtype: torch.dtype
    # None: from the output's state (fresh, or resumed after the committed windows). A cluster
    # replica runs one window range and gives its first window here (see replica.py).
    first_window: int | None = None
