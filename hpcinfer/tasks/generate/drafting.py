"""--speculative's value, and the draft model loaded beside the model (engine/draft.py proposes with it)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from ...config import RunConfig
from ...errors import ConfigError, ModelError
from ...models.decoder_checkpoint import load_decoder, load_tokenizer
from ...models.decoder_inspect import DecoderInfo, inspect_decoder
from ...models.llama import LlamaDecoder
from ...models.registry import resolve_model_path
from ...models.shelf import ModelShelf, shelved


def draft_name(value: str) -> str | None:
    """The model --speculative draft:MODEL names; None for none and ngram; a ConfigError for the rest."""
    if value in ("none", "ngram"):
        return None
    kind, sep, name = value.partition(":")
    if kind != "draft" or not sep or not name.strip():
        raise ConfigError(
            f"--speculative {value!r}: give none, ngram or draft:MODEL (a smaller model, the same tokenizer)"
        )
    return name.strip()


def draft_info(config: RunConfig, tokenizer: Tokenizer) -> DecoderInfo | None:
    """The draft's checkpoint, checked to be a native decoder with the model's own tokenizer; None without one."""
    name = draft_name(config.generate.speculative)
    if name is None:
        return None
    try:
        info = inspect_decoder(resolve_model_path(name))
        vocab = load_tokenizer(info).get_vocab()
    except (ConfigError, ModelError) as exc:
        raise ConfigError(f"--speculative draft:{name}: {exc}") from None
    if vocab != tokenizer.get_vocab():
        raise ConfigError(f"--speculative draft:{name}: its tokenizer is not the model's (a draft must share it)")
    return info


def load_draft(
    info: DecoderInfo | None, device: torch.device, dtype: torch.dtype, shelf: ModelShelf | None = None
) -> LlamaDecoder | None:
    """The draft on `device` (kept on the shelf, for a server's next run), or None."""
    if info is None:
        return None
    key = ("draft", str(info.path), str(device), str(dtype))
    return shelved(shelf, key, lambda: load_decoder(info, device, dtype))
