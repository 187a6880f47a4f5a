"""A request's images through a vision-language model's tower (models/vlm.py), once per device."""

from __future__ import annotations

from typing import Any

import torch

from ..device import accelerators
from ..device.base import is_out_of_memory


def see_images(vision: Any, media: Any, device: torch.device) -> str | None:
    """One vector per image token of the request's prompt, kept on `media` for `device` (a request
    moved to another device after a fault runs the tower again there); None when done, else why the
    tower could not see these images (too many or too large for the device, a token count that does
    not match): that request ends with it, not the run. A device's own fault is raised."""
    key = str(device)
    if key in media.vectors:
        return None
    try:
        if vision is None:
            raise ValueError("a request with images reached an engine without a vision tower")
        vectors = vision.features(media)
        if vectors.shape[0] != len(media.positions):
            raise ValueError(f"{len(media.positions)} image tokens in the prompt, {vectors.shape[0]} image vectors")
    except Exception as exc:
        if not (isinstance(exc, ValueError) or is_out_of_memory(exc)):
            raise
        accelerators.release_cached(device)
        return f"the vision tower failed on its images ({str(exc).splitlines()[0][:160]})"
    media.vectors[key] = vectors
    return None
