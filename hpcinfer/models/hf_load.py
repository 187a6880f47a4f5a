"""Loading a checkpoint through transformers (`--backend transformers`, and what `auto` falls back
to): never the checkpoint's own code, and without transformers' own progress bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def quiet_from_pretrained(cls: Any, path: Path, dtype: torch.dtype, **kwargs: Any) -> Any:
    """transformers' `cls.from_pretrained` (never the checkpoint's own code; `kwargs` are its own),
    without transformers' own progress bars: the run's progress is hpcinfer's, on the native path
    and on this one alike."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        return cls.from_pretrained(path, dtype=dtype, trust_remote_code=False, **kwargs)
    finally:
        if shown:
            logging.enable_progress_bar()


def tower_from_pretrained(cls: Any, path: Path, dtype: torch.dtype, config: Any) -> Any:
    """One tower of a two-tower checkpoint (CLIP's image or text half), quietly: the other half's
    weights are expected to be left over, so transformers' table of them is not printed; a weight
    the tower needs and the checkpoint lacks is a ModelError naming it."""
    from transformers.utils import logging

    from ..errors import ModelError

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        tower, loading = quiet_from_pretrained(cls, path, dtype, config=config, output_loading_info=True)
    finally:
        logging.set_verbosity(level)
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelError(f"the checkpoint lacks weights its {cls.__name__} needs: {named}", path=str(path))
    return tower


__all__ = ["quiet_from_pretrained", "tower_from_pretrained"]
