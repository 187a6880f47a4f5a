"""A request row's own sampling parameters over the run's defaults, each checked (a malformed value
raises ValueError: the row's reject), and vLLM's `bad_words` as token id sequences."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from ...engine.sequence import SamplingParams

# NOTE: set otherwise: ignore_eos by the run, structured by spec_from_body, bad_words and lora below / by
# name, media by an image chat's parts
_PARAM_NAMES = {f.name for f in fields(SamplingParams)} - {"ignore_eos", "structured", "bad_words", "lora", "media"}


def row_params(defaults: SamplingParams, obj: dict[str, Any], vocab_size: int) -> SamplingParams:
    """Row overrides on the run's defaults; a malformed value raises ValueError (a reject)."""
    over: dict[str, Any] = {}
    for name in _PARAM_NAMES:
        value = obj.get(name)
        if name == "max_tokens" and value is None:
            value = obj.get("max_completion_tokens")
        if value is None:
            continue
        if name == "logprobs":  # chat: logprobs true + top_logprobs K; completions: logprobs K
            if value is False:
                continue
            value = obj.get("top_logprobs") or 0 if value is True else value
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"logprobs must be true or an integer, got {value!r}")
        elif name == "logit_bias":  # OpenAI's {"token id": bias}
            if not isinstance(value, dict):
                raise ValueError(f"logit_bias must be an object of token id to bias, got {value!r}")
            try:
                value = tuple(sorted((int(k), float(v)) for k, v in value.items()))
            except (TypeError, ValueError):
                raise ValueError("logit_bias keys must be token ids and values numbers") from None
            if any(not 0 <= k < vocab_size for k, _ in value):
                raise ValueError(f"logit_bias names a token id outside the vocabulary (0..{vocab_size - 1})")
        elif name == "allowed_token_ids":  # vLLM's: a list of token ids, the only ones the answer may hold
            if isinstance(value, str | bool) or not isinstance(value, list | tuple) or not value:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {value!r}")
            if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in value):
                raise ValueError(f"allowed_token_ids must be token ids in the vocabulary (0..{vocab_size - 1})")
            value = tuple(sorted(set(value)))
        elif name in ("stop", "stop_token_ids"):
            value = (value,) if isinstance(value, str | int) else tuple(value)
            if not all(isinstance(v, str if name == "stop" else int) for v in value):
                raise ValueError(f"{name} must be {'strings' if name == 'stop' else 'integers'}")
        elif name in ("max_tokens", "top_k", "seed", "min_tokens", "n", "prompt_logprobs", "beam_width"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        over[name] = value
    return replace(defaults, **over)


def bad_word_ids(words: Any, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token id sequences: each word as written and with a leading space (the
    two spellings a tokenizer gives a word inside a text), without special tokens."""
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError("bad_words must be a list of non-empty strings")
    found = set()
    for word in words:
        for spelling in {word, " " + word.lstrip()}:
            ids = tuple(tokenizer.encode(spelling, add_special_tokens=False).ids)
            if ids:
                found.add(ids)
    return tuple(sorted(found))
