"""CLIP and SigLIP checkpoints (`CLIPModel`, `SiglipModel`, and sentence-transformers CLIP folders):
an image or a text embedded into the shared space, as `get_image_features` / `get_text_features` do.

A run embeds one modality: each row's image (`--image-column`: the decode stage gives uint8 pixels
[rows, height * width * 3], normalised here on the device) or each row's text (token ids as the
encoder pipeline gives every text model), run on the pipeline's batches beside the decode stage,
with the pinned uint8 staging, batching, resume and rejects. An image run's tower is hpcinfer's
own vision transformer (models/vit.py: fused Q/K/V; on the CPU, oneDNN linears with the MLP's
activation fused), built from the checkpoint's files without importing transformers (its CLIP
modules took ~3.5 s of a run's start), with transformers' arithmetic and its time cut by a sixth
or more; a text run's tower is built so too (models/clip_text.py). A sharded checkpoint, a tower
with an activation vit.py does not fuse, and SigLIP without its pooling head run on transformers'
own modules.

For an image run the checkpoint's facts describe a row of pixels: `max_position_embeddings` is a
row's bytes, `vocab_size` 256 (a byte's values), so the pipeline's length checks, batching and
staging hold pixels as they hold token ids.

SigLIP's text tower was trained on texts padded to its 64 positions and pools the last position
(its processor pads with `padding="max_length"`): its rows are padded so here too, unmasked. CLIP
masks its padding and pools the end-of-text token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ModelError
from .batch_model import BatchSteps
from .checkpoint import CheckpointInfo, read_model_json, require_weights, sentence_transformers_info
from .clip_text import TextTower, load_text_tower
from .hf_load import tower_from_pretrained
from .vision import ImageSpec, read_image_spec
from .vit import VisionTower
from .vit_load import load_vision_tower, native_tower

CLIP_TYPES = ("clip", "siglip")
# (model_type, images) -> transformers' tower: its embeddings are get_image_features' / get_text_features'
TOWERS = {
    ("clip", True): "CLIPVisionModelWithProjection",
    ("clip", False): "CLIPTextModelWithProjection",
    ("siglip", True): "SiglipVisionModel",
    ("siglip", False): "SiglipTextModel",
}


@dataclass(frozen=True, slots=True)
class ClipConfig:
    """What the pipeline reads of a CLIP/SigLIP checkpoint for one modality (see the module docstring)."""

    model_type: str
    vocab_size: int
    hidden_size: int  # the shared space's dimensions
    max_position_embeddings: int  # text positions, or an image row's bytes
    pad_token_id: int = 0
    image: ImageSpec | None = None  # set for an image run
    position_offset: int = 0


@dataclass(frozen=True, slots=True)
class ClipHead:
    """heads.Head: a row's image or text embedded into the shared space (`images` picks which)."""

    images: bool = False
    ragged = None

    def width(self, info: Any) -> int:
        return info.pooling.dimensions or info.config.hidden_size

    def load(self, info: Any, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool) -> BatchSteps:
        """The one tower the run uses (its weights only: an image run never loads the text tower).
        A tower hpcinfer runs natively is built from the checkpoint's files alone, without
        transformers (models/vit_load.py, models/clip_text.py); the rest are transformers' towers."""
        spec = info.config.image
        raw = read_model_json(info.path / "config.json")
        if self.images:
            native = load_vision_tower(info.path, raw, device, dtype, cpu_fast_path)
            if native is not None:
                _check_size(native.shape.image_size, spec, info.path)
                return ClipImageEmbedder(native, info.config, info.pooling, dtype)
        else:
            text = load_text_tower(info.path, raw, device, dtype, cpu_fast_path)
            if text is not None:
                return ClipTextEmbedder(text, info.config, info.pooling)
        try:
            import transformers  # noqa: F401  (checked here: a missing install is one line)
        except ImportError:
            kind = info.config.model_type
            raise ModelError(f"{kind} runs on transformers' towers: pip install 'hpcinfer[images]'") from None
        cls, sub = tower_class(info.path, info.config.model_type, self.images)
        tower = tower_from_pretrained(cls, info.path, dtype, sub)
        model = tower.to(device).eval()
        if self.images:
            _check_size(sub.image_size, spec, info.path)
            native = native_tower(model, info.config.model_type, cpu_fast_path)
            return ClipImageEmbedder(native or model, info.config, info.pooling, dtype)
        return ClipTextEmbedder(model, info.config, info.pooling)


def _check_size(size: int, spec: ImageSpec, path: Path) -> None:
    """The image processor's output size is the tower's input size."""
    if (spec.height, spec.width) != (size, size):
        raise ModelError(
            f"its image processor makes {spec.width}x{spec.height} images; its tower takes {size}x{size}",
            path=str(path),
        )


def tower_class(path: Path, model_type: str, images: bool) -> tuple[Any, Any]:
    """transformers' class of the checkpoint's image or text tower, and that tower's config."""
    import transformers

    full = transformers.AutoConfig.from_pretrained(str(path))
    sub = full.vision_config if images else full.text_config
    if hasattr(full, "projection_dim"):  # NOTE: CLIP names the shared space's size once, at the top
        sub.projection_dim = full.projection_dim
    return getattr(transformers, TOWERS[(model_type, images)]), sub


def is_clip(path: Path) -> bool:
    raw = read_model_json(path / "config.json") if (path / "config.json").is_file() else None
    return isinstance(raw, dict) and raw.get("model_type") in CLIP_TYPES


def inspect_clip(path: Path, images: bool) -> CheckpointInfo:
    """A CLIP/SigLIP checkpoint read for an image run (`images`) or a text run."""
    raw = read_model_json(path / "config.json")
    assert isinstance(raw, dict)
    require_weights(path)
    kind = str(raw["model_type"])
    text = raw.get("text_config") or {}
    dim = int(raw.get("projection_dim") or text.get("projection_size") or text.get("hidden_size") or 0)
    if not dim:
        raise ModelError(f"{kind} checkpoint names no embedding size (projection_dim)", path=str(path))
    if images:
        spec = read_image_spec(path)
        config = ClipConfig(kind, 256, dim, spec.row_bytes, 0, spec)
    else:
        if not (path / "tokenizer.json").is_file():
            raise ModelError("a text run needs the checkpoint's tokenizer.json", path=str(path))
        positions = int(text.get("max_position_embeddings", 77 if kind == "clip" else 64))
        pad = int(text.get("pad_token_id", 1) if kind == "siglip" else 0)
        config = ClipConfig(kind, int(text.get("vocab_size", 49408)), dim, positions, pad)
    info = sentence_transformers_info(path, config)
    length = config.max_position_embeddings if images else min(info.max_seq_length, config.max_position_embeddings)
    return replace(info, max_seq_length=length, head=ClipHead(images))


def _features(output: Any) -> torch.Tensor:
    """A tower's embeddings: CLIP's projected `image_embeds` / `text_embeds`, SigLIP's `pooler_output`
    (its attention-pooling head's, or its text head's)."""
    for name in ("image_embeds", "text_embeds", "pooler_output"):
        if getattr(output, name, None) is not None:
            return getattr(output, name)
    raise ModelError("the tower gave no embeddings (image_embeds, text_embeds or pooler_output)")


class ClipImageEmbedder(BatchSteps):
    def __init__(self, model: Any, config: ClipConfig, pooling: Any, dtype: torch.dtype) -> None:
        assert config.image is not None
        self.model, self.spec, self.pooling, self.dtype = model, config.image, pooling, dtype
        self.output_dim = pooling.dimensions or config.hidden_size

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        pixels = self.spec.normalise(ids[:, : self.spec.row_bytes], self.dtype)
        if isinstance(self.model, VisionTower):
            return self.model(pixels)
        return _features(self.model(pixel_values=pixels))

    def postprocess(self, outputs: object) -> torch.Tensor:
        return _finish(outputs, self.pooling)  # type: ignore[arg-type]


class ClipTextEmbedder(BatchSteps):
    def __init__(self, model: Any, config: ClipConfig, pooling: Any) -> None:
        self.model, self.config, self.pooling = model, config, pooling
        self.output_dim = pooling.dimensions or config.hidden_size

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        ids = ids.long()
        if self.config.model_type == "siglip":  # NOTE: as trained: padded to every position, unmasked
            full = ids.new_full((ids.shape[0], self.config.max_position_embeddings), self.config.pad_token_id)
            keep = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
            full[:, : ids.shape[1]] = torch.where(keep, ids, self.config.pad_token_id)
            return self.model(full) if isinstance(self.model, TextTower) else _features(self.model(input_ids=full))
        if isinstance(self.model, TextTower):
            return self.model(ids, lengths)
        mask = (torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]).long()
        return _features(self.model(input_ids=ids, attention_mask=mask))

    def postprocess(self, outputs: object) -> torch.Tensor:
        return _finish(outputs, self.pooling)  # type: ignore[arg-type]


def _finish(vectors: torch.Tensor, pooling: Any) -> torch.Tensor:
    vectors = vectors.float()
    if pooling.dimensions:
        vectors = vectors[:, : pooling.dimensions]
    return F.normalize(vectors, p=2, dim=1) if pooling.normalize else vectors
