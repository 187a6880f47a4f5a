"""Stage 2 of an image run, decode: RowBlocks of image references -> TokenBlocks of uint8 pixels.

Where a text run tokenizes, an image run (`--image-column`) reads each row's image (a local path,
relative to its input file's folder; a `file://` or object-store URI; or bytes from a Parquet binary
column), decodes it with Pillow and makes it the checkpoint's input size (models/vision.py), in a
pool of threads (Pillow releases the GIL while it decodes and resizes). A row's pixels travel as
its "tokens": every row is `height * width * 3` bytes, so the planner, the uint8 staging ring and
the executor carry them as they carry token ids, and the model normalises them on the device.

Pillow: the maintained decoder for every format a user has (JPEG, PNG, WebP, GIF, TIFF, BMP; CMYK
and palette images), with libjpeg-turbo in its wheels and DCT-domain downscaling (`draft`) for
large JPEGs; torchvision's decoders would tie the install to one torch build.

A missing file, one that is not an image, a truncated one, or one too large to decode safely is a
reject with its reason (`image_missing`, `image_unreadable`, `image_remote`: files/image_urls.py
guards what may be read); the rest go on in order.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from ..config import RunConfig
from ..errors import ConfigError
from ..files.image_urls import ImageRefused, image_bytes
from ..models.vision import ImageSpec, model_pixels
from ..types import Reject, RowBlock
from .types import TokenBlock

# The CPU default of an image batch (a GPU takes more): its pixels are staged as one uint8 slab.
CPU_IMAGE_BATCH, CUDA_IMAGE_BATCH = 32, 256
MAX_PIXELS = 89_478_485  # Pillow's own decompression-bomb warning level: larger images are rejects


class ImageProblem(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def image_budget(config: RunConfig, spec: ImageSpec, device_kind: str) -> RunConfig:
    """The run's plan for pixels: a batch of --max-batch-size images at most (CPU 32, GPU 256 by
    default), its budget in bytes, rows never padded (every row is one image's bytes)."""
    default = CUDA_IMAGE_BATCH if device_kind == "cuda" else CPU_IMAGE_BATCH
    rows = min(config.plan.max_batch_size, default)
    plan = replace(config.plan, max_batch_tokens=rows * spec.row_bytes, max_batch_size=rows, pad_multiple=1)
    return replace(config, plan=plan)


def decode_row(ref: Any, source: str, spec: ImageSpec, files: bool = True) -> np.ndarray:
    """One row's pixels, or an ImageProblem saying why there are none."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(image_bytes(ref, source, files)))
        if image.width * image.height > MAX_PIXELS:
            raise ImageProblem("image_unreadable", f"{image.width}x{image.height} pixels: too large to decode")
        return model_pixels(image, spec)
    except ImageRefused as refused:
        raise ImageProblem(refused.reason, str(refused)) from None
    except UnidentifiedImageError:
        raise ImageProblem("image_unreadable", "not an image Pillow can read") from None
    except (OSError, ValueError, SyntaxError, MemoryError, Image.DecompressionBombError) as exc:
        raise ImageProblem("image_unreadable", f"cannot decode the image ({str(exc).splitlines()[0][:200]})") from None


class DecodeStage:
    """Consumes RowBlock (images in `texts`' place), produces TokenBlock (pixels as uint8 ids)."""

    name = "decode"

    def __init__(self, spec: ImageSpec, threads: int, files: bool = True) -> None:
        """`files`: whether rows may name image files and URIs (serve: inline bytes only)."""
        try:
            from PIL import Image
        except ImportError:
            raise ConfigError("--image-column decodes images with Pillow: pip install 'hpcinfer[images]'") from None
        # NOTE: the size check above rejects what Pillow would warn of; set once, not per thread
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
        self.spec, self.files = spec, files
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="hpcinfer-decode")

    def process(self, block: RowBlock) -> Iterator[TokenBlock]:
        refs = block.images or []
        source = block.source
        results = list(self.pool.map(lambda ref: self._one(ref, source), refs))
        rejects = list(block.rejects)
        keep = [i for i, r in enumerate(results) if isinstance(r, np.ndarray)]
        for i, r in enumerate(results):
            if isinstance(r, ImageProblem):
                row = block.rows[i]
                rejects.append(
                    Reject(row, source, block.lines[i], block.ids[i], r.reason, r.message, row - block.file_first_row)
                )
        width = self.spec.row_bytes
        flat = np.empty(len(keep) * width, dtype=np.uint8)
        for j, i in enumerate(keep):
            flat[j * width : (j + 1) * width] = results[i].reshape(-1)
        yield TokenBlock(
            block.block_id,
            block.first_row,
            block.input_rows,
            [block.ids[i] for i in keep],
            flat,
            np.full(len(keep), width, dtype=np.int32),
            rejects=rejects,
            rows=np.asarray([block.rows[i] for i in keep], dtype=np.int64),
            source=source,
            arrival_ns=block.arrival_ns[np.asarray(keep, dtype=np.int64)] if block.arrival_ns is not None else None,
            file_first_row=block.file_first_row,
        )

    def _one(self, ref: Any, source: str) -> np.ndarray | ImageProblem:
        try:
            return decode_row(ref, source, self.spec, self.files)
        except ImageProblem as problem:
            return problem

    def finish(self) -> Iterator[TokenBlock]:
        self.pool.shutdown(wait=False)
        return iter(())


def decode_threads(config: RunConfig) -> int:
    """--tokenize-threads where given above 1, else one per core (decoding is an image run's CPU work)."""
    return config.tokenize.threads if config.tokenize.threads > 1 else max(1, os.cpu_count() or 1)


__all__ = ["DecodeStage", "ImageProblem", "decode_row", "decode_threads", "image_budget"]
