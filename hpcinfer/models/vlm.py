"""Vision-language models in the paged engine: Idefics3 / SmolVLM (a SigLIP vision tower, a
pixel-shuffle connector, and a Llama text model).

Why this family: its text half is the Llama the native engine already runs (continuous batching,
the prefix cache, structured output, every sampling option), its image tokens are plain
placeholder ids whose embeddings the image's features replace (no multi-dimensional positions, as
Qwen2-VL's M-RoPE would need), and SmolVLM-256M runs on a CPU.

How a request runs: the request reader renders the chat (an `image_url` part becomes the
template's image) and hands the text and its images to the checkpoint's own processor
(transformers'), which expands each image into its tokens and makes its pixels (`Media`). When the
engine admits the request, the vision tower (`VisionTower`, transformers' module) turns the pixels
into one vector per image token, on the engine's device; the prefill chunks that cover those
positions take the vectors in place of the token embeddings (runner.py). The prefix cache keys the
prompt's blocks by the images' SHA-256 too, so two questions about one image share its blocks and
two images never do.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError, UnsupportedModel
from .hf_load import quiet_from_pretrained

VLM_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
TEXT_PREFIX = "model.text_model."


@dataclass(frozen=True, slots=True)
class VisionInfo:
    architecture: str
    image_token_id: int


@dataclass(slots=True)
class Media:
    """A request's images as its processor made them, and their digest (the prefix cache's key)."""

    pixel_values: torch.Tensor  # [1, images, 3, H, W]
    pixel_attention_mask: torch.Tensor | None
    digest: bytes
    positions: Any = None  # int64 [image tokens]: where the prompt's image tokens are, ascending
    # [image tokens, hidden] by device: a request moved to another device (a fault) runs its tower there
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)


def is_vlm(raw: Any) -> bool:
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    return any(str(a) in VLM_ARCHITECTURES for a in archs or [])


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The Llama text model's config.json, as the native decoder reads one."""
    text = dict(raw.get("text_config") or {})
    if text.get("model_type", "llama") != "llama":
        kind = text["model_type"]
        raise UnsupportedModel(f"a {raw['architectures'][0]} whose text model is {kind!r} (native: llama)")
    text["architectures"] = ["LlamaForCausalLM"]
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return text


def vision_info(raw: dict[str, Any]) -> VisionInfo:
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if token is None:
        raise ModelError(f"{raw['architectures'][0]} config names no image_token_id")
    return VisionInfo(str(raw["architectures"][0]), int(token))


def text_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's weights under a causal LM's names (the vision tower's are its own)."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith(TEXT_PREFIX):
            out["model." + name[len(TEXT_PREFIX) :]] = tensor
        elif name == "lm_head.weight":
            out[name] = tensor
    return out


class VisionTower:
    """The checkpoint's vision encoder and connector (transformers' modules) on one device."""

    def __init__(self, path: Path, info: VisionInfo, device: torch.device, dtype: torch.dtype) -> None:
        import transformers

        cls = getattr(transformers, info.architecture)
        model = quiet_from_pretrained(cls, path, dtype)  # NOTE: the run's progress is hpcinfer's, not transformers'
        inner = model.model
        inner.text_model = None  # NOTE: the native engine runs the text model
        self.model = inner.to(device).eval()
        self.device, self.dtype = device, dtype

    @torch.inference_mode()
    def features(self, media: Media) -> torch.Tensor:
        """One vector per image token of the request, in prompt order."""
        pixels = media.pixel_values.to(self.device, self.dtype)
        mask = media.pixel_attention_mask
        out = self.model.get_image_features(pixels, mask.to(self.device) if mask is not None else None)
        hidden = out if isinstance(out, torch.Tensor) else out.pooler_output  # NOTE: transformers 5: one per prompt
        if isinstance(hidden, list | tuple):
            hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden])
        return hidden.reshape(-1, hidden.shape[-1])


class ImagePrompts:
    """Renders an image chat's tokens and pixels with the checkpoint's own processor."""

    def __init__(self, path: Path, image_token_id: int) -> None:
        try:
            import transformers
        except ImportError:
            raise ModelError("a vision-language model needs transformers: pip install 'hpcinfer[images]'") from None
        self.processor = transformers.AutoProcessor.from_pretrained(str(path))
        self.image_token_id = image_token_id

    def encode(self, text: str, images: list[bytes]) -> tuple[list[int], Media | None]:
        from PIL import Image

        if not images:
            ids = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
            return list(ids), None
        opened = []
        for k, data in enumerate(images):
            try:
                image = Image.open(io.BytesIO(data))
                image.load()
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
                raise ValueError(f"image {k + 1} is not an image Pillow can read ({str(exc)[:120]})") from None
            opened.append(image)
        out = self.processor(text=[text], images=[opened], return_tensors="pt", add_special_tokens=False)
        digest = hashlib.sha256(b"".join(hashlib.sha256(d).digest() for d in images)).digest()
        mask = out.get("pixel_attention_mask")
        ids = out["input_ids"][0]
        positions = (ids == self.image_token_id).nonzero().flatten().numpy()
        return ids.tolist(), Media(out["pixel_values"], mask, digest, positions)
