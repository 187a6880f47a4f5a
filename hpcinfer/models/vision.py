"""How a vision checkpoint wants its images (`preprocessor_config.json`), and an image made so.

The decode stage (pipeline/decode.py) turns each row's file into the model's input size here, as
uint8 RGB pixels [height, width, 3]: the resize and crop of transformers' PIL image processors
(CLIP: the shortest edge to `size`, bicubic, then a centre crop; SigLIP: straight to height x
width), transparency composited onto white as transformers' `convert_to_rgb` does. Rescaling and
normalising are arithmetic on the device (`ImageSpec.normalise`), so the host moves a quarter of
the bytes float32 pixels would take.

A JPEG much larger than the model's input is decoded at a reduced scale (libjpeg's DCT scaling,
PIL's `draft`: 1/2, 1/4 or 1/8, never below four times the size the resize needs). That skips
much of the decode's work and moves the resized pixels by a fraction of a level on average;
`exact=True` decodes every pixel.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_RESIZED = 1 << 26  # pixels an image may be resized to before its crop (a 1 x 1,000,000 strip would be 224 x 224M)
DRAFT_MARGIN = 4  # a JPEG is decoded at a reduced scale only while it stays this many times the resize's size


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """The resize (`shortest_edge`, or `height` x `width`), the crop, and the normalisation."""

    height: int  # of the model's input, after resize and crop
    width: int
    shortest_edge: int | None = None  # resize the shortest edge to this (then crop), else straight to height x width
    resample: int = 3  # PIL's: 3 is bicubic
    rescale: float = 1 / 255
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @property
    def row_bytes(self) -> int:
        return self.height * self.width * 3

    def normalise(self, pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 rows [n, height * width * 3] -> pixel values [n, 3, height, width] in `dtype`."""
        n = pixels.shape[0]
        x = pixels.view(n, self.height, self.width, 3).permute(0, 3, 1, 2).float() * self.rescale
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return ((x - mean) / std).to(dtype)


def read_image_spec(path: Path) -> ImageSpec:
    """The checkpoint's `preprocessor_config.json` as an ImageSpec."""
    file = path / "preprocessor_config.json"
    if not file.is_file():
        raise ModelError("vision checkpoint has no preprocessor_config.json", path=str(path))
    raw: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
    raw = raw.get("image_processor", raw)  # NOTE: a processor_config.json-style file nests it
    size = raw.get("size") or {}
    crop = raw.get("crop_size") or {}
    shortest = size.get("shortest_edge") if isinstance(size, dict) else int(size)
    if raw.get("do_center_crop", bool(crop)) and crop:
        height, width = int(crop["height"]), int(crop["width"])
    elif shortest:
        height = width = int(shortest)
    else:
        height, width = int(size["height"]), int(size["width"])
    mean = raw.get("image_mean", CLIP_MEAN) if raw.get("do_normalize", True) else (0.0, 0.0, 0.0)
    std = raw.get("image_std", CLIP_STD) if raw.get("do_normalize", True) else (1.0, 1.0, 1.0)
    return ImageSpec(
        height,
        width,
        int(shortest) if shortest and raw.get("do_resize", True) else None,
        int(raw.get("resample", 3)),
        float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else 1.0,
        tuple(float(v) for v in _three(mean)),
        tuple(float(v) for v in _three(std)),
    )


def _three(value: Any) -> list[float]:
    return [value] * 3 if isinstance(value, int | float) else list(value)


def resize_size(spec: ImageSpec, width: int, height: int) -> tuple[int, int]:
    """(width, height) the image is resized to, as transformers' `get_resize_output_image_size`."""
    if spec.shortest_edge is None:
        return spec.width, spec.height
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = spec.shortest_edge, int(spec.shortest_edge * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def model_pixels(image: Any, spec: ImageSpec, exact: bool = False) -> np.ndarray:
    """An opened PIL image -> uint8 [height, width, 3] as the checkpoint's processor makes it."""
    from PIL import Image

    want = resize_size(spec, *image.size)  # NOTE: of the whole image, whatever scale it is decoded at
    if want[0] * want[1] > MAX_RESIZED:
        raise ValueError(f"a {image.width}x{image.height} image: its aspect ratio is too extreme to resize")
    if not exact and image.format == "JPEG":
        image.draft("RGB", (want[0] * DRAFT_MARGIN, want[1] * DRAFT_MARGIN))
    image.load()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    elif image.mode != "RGB":
        image = image.convert("RGB")
    image = image.resize(want, resample=spec.resample)
    pixels = np.asarray(image, dtype=np.uint8)
    top, left = (pixels.shape[0] - spec.height) // 2, (pixels.shape[1] - spec.width) // 2
    return np.ascontiguousarray(pixels[top : top + spec.height, left : left + spec.width])
