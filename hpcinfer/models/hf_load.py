"""Loading a checkpoint through transformers (`--backend transformers`, and what `auto` falls back
to): never the checkpoint's own code, and without transformers' own progress bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def quiet_from_pretrained(cls: Any, path: Path, dtype: torch.dtype) -> Any:
    """transformers' `cls.from_pretrained` (never the checkpoint's own code), without transformers'
    own progress bars: the run's progress is hpcinfer's, on the native path and on this one alike."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        return cls.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    finally:
        if shown:
            logging.enable_progress_bar()


__all__ = ["quiet_from_pretrained"]
