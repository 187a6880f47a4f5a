"""Load a Hugging Face checkpoint directory: config, safetensors weights, sentence-transformers config.

NOTE: nothing in a model directory is ever imported or executed; weights load through safetensors
only, and JSON files are parsed as data.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import ModelError, UnsupportedModel
from .bert import BertEncoder, can_pack_for_cpu, pack_for_cpu
from .classifier import ClassificationHead, SequenceClassifier, classifier_config, pair_separator, split_weights
from .encoders import ENCODER_TYPES as ENCODER_TYPES  # re-exported: the native encoders' model_types
from .encoders import encoder_config, encoder_from_weights
from .st_files import POOLING_MODES as POOLING_MODES  # re-exported: the modes --pooling takes
from .st_files import modules_pooling, read_model_json, truncation_length

DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # decoder embedders (models/decoder_embedder.py)


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """How token states become one vector: 'mean', 'cls', 'max', 'mean_sqrt_len' or 'last' (the
    last real token), L2-normalised or not, its first `dimensions` kept (all when None)."""

    mode: str = "mean"
    normalize: bool = False
    dimensions: int | None = None


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """An embedding checkpoint: a BERT-family encoder, or (`decoder` set: its DecoderInfo) a
    Llama-family decoder whose config is a DecoderConfig (models/decoder_embedder.py)."""

    path: Path
    config: Any  # BertConfig, or DecoderConfig for a decoder embedder: vocab_size, hidden_size, positions
    pooling: PoolingSpec
    max_seq_length: int  # the length sentence-transformers truncates to
    prompts: dict[str, str] = field(default_factory=dict)  # config_sentence_transformers.json's, by name
    prompt: str = ""  # put before every text
    decoder: Any = None  # a decoder embedder's DecoderInfo
    classifier: Any = None  # a sequence classifier's ClassifierSpec (--task classify)
    # What a row gives and how the model is built (models/heads.py's `Head`): set by what reads the
    # checkpoint for a task (registry.inspect_embedder, a task's own inspect). Module-level, so Ray can ship it.
    head: Any = None

    @property
    def ragged(self) -> Any:
        """The head's `values.RaggedSpec` where a row's values are ragged items (NER, SPLADE, token
        embeddings); None where they are a dense vector of `output_dim` values."""
        return self.head.ragged

    def __post_init__(self) -> None:
        assert self.head is None or hasattr(self.head, "load"), "a head is a models.heads.Head"

    @property
    def output_dim(self) -> int:
        """Dense values per row: the embedding's dimensions, a classifier's labels (0 for ragged items)."""
        return int(self.head.width(self))


def model_dir_config(path: Path, weights: bool = True) -> Any:
    """The config.json of a checkpoint directory that has its tokenizer.json (and, with `weights`,
    its weights: `require_weights`)."""
    if not path.is_dir():
        raise ModelError("model directory not found", path=str(path))
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelError(f"model directory has no {name}", path=str(path))
    if weights:
        require_weights(path)
    return read_model_json(path / "config.json")


def require_weights(path: Path) -> None:
    """The native loaders read one model.safetensors or pytorch_model.bin (not a sharded index)."""
    if weights_file(path) is not None:
        return
    if (path / "model.safetensors.index.json").is_file():  # NOTE: --backend auto loads it through transformers
        raise UnsupportedModel("no native loader for sharded weights (model.safetensors.index.json)", path=str(path))
    raise ModelError("model directory has no model.safetensors (nor pytorch_model.bin)", path=str(path))


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    """Validates an encoder checkpoint directory (models/encoders.py: any native architecture) and
    reads everything but the weights."""
    config = encoder_config(model_dir_config(path, weights=False), path)  # NOTE: the architecture first
    require_weights(path)
    info = sentence_transformers_info(path, config)
    longest = config.max_position_embeddings - config.position_offset
    return replace(info, max_seq_length=min(info.max_seq_length, longest))


def sentence_transformers_info(
    path: Path, config: Any, default_pooling: str = "mean", decoder: Any = None
) -> CheckpointInfo:
    """The checkpoint's sentence-transformers files (pooling, max_seq_length, prompts) over `config`,
    whichever version wrote them (models/st_files.py); pooling `default_pooling` where they name none."""
    max_len = truncation_length(path, config.max_position_embeddings)
    prompts: dict[str, str] = {}
    prompt = ""
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():
        raw_st = read_model_json(st_config)
        if isinstance(raw_st, dict):
            prompts = {str(k): str(v) for k, v in (raw_st.get("prompts") or {}).items()}
            prompt = prompts.get(str(raw_st.get("default_prompt_name")), "")  # as sentence-transformers encodes
    mode, normalize = modules_pooling(path)
    pooling = PoolingSpec(mode=mode or default_pooling, normalize=normalize)
    return CheckpointInfo(path, config, pooling, max_len, prompts, prompt, decoder)


def weights_file(path: Path) -> Path | None:
    """model.safetensors, else pytorch_model.bin (loaded with weights_only: tensors, never code); a
    single-file checkpoint (GGUF) is its own weights file."""
    if path.is_file():
        return path
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    return None


def load_weights(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors and torch.load raise their own error types
        raise ModelError(f"cannot load weights ({exc})", path=str(file)) from None


def inspect_classifier(path: Path, score: bool = False) -> CheckpointInfo:
    """A `*ForSequenceClassification` checkpoint (BERT, RoBERTa / XLM-R, DistilBERT): its encoder's
    config, its labels, its sentence-transformers max_seq_length where it has one; `score`: as a
    cross-encoder (--task score), with the separator that splits a pair's token types."""
    raw = model_dir_config(path, weights=False)
    if not isinstance(raw, dict):
        raise ModelError("config.json is not an object", path=str(path))
    config, spec = classifier_config(raw, path, score)
    require_weights(path)
    if score and config.type_vocab_size > 1:
        spec = replace(spec, sep_id=pair_separator(path))
    info = sentence_transformers_info(path, config, "cls")
    longest = config.max_position_embeddings - config.position_offset
    return replace(info, max_seq_length=min(info.max_seq_length, longest), classifier=spec, head=ClassifierHead())


@dataclass(frozen=True, slots=True)
class ClassifierHead:
    """heads.Head: a `*ForSequenceClassification` checkpoint's head on its encoder: each label's
    probability, or a cross-encoder's one score (`info.classifier`, a ClassifierSpec)."""

    ragged = None

    def width(self, info: CheckpointInfo) -> int:
        return len(info.classifier.labels)

    def load(self, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool) -> Any:
        encoder, head = load_classifier(info)
        encoder = encoder.to(device=device, dtype=dtype)
        if cpu_fast_path and can_pack_for_cpu(encoder):
            encoder = pack_for_cpu(encoder)
        return SequenceClassifier(encoder, head.to(device=device, dtype=dtype), info.classifier, dtype)


def load_classifier(info: CheckpointInfo) -> tuple[BertEncoder, ClassificationHead]:
    """The classifier's encoder and head (float32, CPU); strict about missing tensors."""
    file = weights_file(info.path)
    assert file is not None, "inspect_classifier checked it"
    encoder_weights, head_weights = split_weights(load_weights(file), info.classifier)
    head = ClassificationHead(info.classifier, info.config.hidden_size)
    missing = sorted(set(head.state_dict()) - set(head_weights))
    if missing:
        raise ModelError(f"the classification head's weights are missing {missing}", path=str(file))
    head.load_state_dict({k: v.float() for k, v in head_weights.items()})
    return encoder_from_weights(info.config, encoder_weights, file), head.eval().requires_grad_(False)


def load_encoder(info: CheckpointInfo) -> Any:
    """Builds the encoder and loads its weights (float32, CPU); strict about missing tensors."""
    file = weights_file(info.path)
    assert file is not None, "inspect_checkpoint checked it"
    return encoder_from_weights(info.config, load_weights(file), file)
