"""An embedding tuning trial: the tune harness's `TrialRunner` running the embedding job on the
sample, with one model loaded for every trial."""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..device import make_device, resolve_dtype
from ..models.registry import LoadedModel, load_model
from ..obs.progress import Progress
from ..tune.trial import TrialRunner
from .given import RunExtras
from .job import run_embed
from .options import embed_checkpoint
from .report import RunReport


class EmbedTrialRunner(TrialRunner):
    """The harness's runner with the embedding job, quiet, on one model loaded for every trial."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, run_job=self._run_quietly, **kwargs)

    def _run_quietly(self, config: RunConfig) -> RunReport:
        return run_embed(config, RunExtras(Progress("off"), model=self._model(config)))

    def _model(self, config: RunConfig) -> LoadedModel:
        """Loaded once for all trials: loading it per run would cost time and, held by the
        allocator afterwards, inflate the memory later trials are charged with."""
        if self._loaded is None:  # NOTE: with --devices, for the first one (the others load their own)
            first = config.device.devices.split(",")[0].strip() if config.device.devices else config.device.device
            device = make_device("cuda:0" if first == "all" else first, 1)
            try:
                dtype = resolve_dtype(config.device.dtype, device)
                self._loaded = load_model(embed_checkpoint(config), device.torch_device, dtype)
            finally:
                device.close()
        return self._loaded
