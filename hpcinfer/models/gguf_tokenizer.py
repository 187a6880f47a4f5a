"""The tokenizer a GGUF file describes, built with `tokenizers` from the file's metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, its merges, each token's type and the
special token ids under llama.cpp's key names. For a byte-level BPE vocabulary (`tokenizer.ggml.model`
"gpt2": GPT-2, Llama 3, Qwen2, SmolLM) that is enough to rebuild the tokenizer exactly as
`transformers` rebuilds it from the same file: a BPE model over the byte-level alphabet, the
pre-tokenizer split the vocabulary's merges were learned with, and its control tokens kept whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ..errors import ModelError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 5 unused, 6 byte)

# The split each vocabulary's merges were learned with, by `tokenizer.ggml.pre`. A name not listed
# here (gpt2, smollm, default, ...) splits with GPT-2's own pattern, the ByteLevel default.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (a byte-level vocabulary's spelling)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _respell(token: str, alphabet: frozenset[str]) -> str:
    """A token already in the byte alphabet stays; any other is spelled from its UTF-8 bytes."""
    if set(token) <= alphabet:
        return token
    spelling = byte_alphabet()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def gguf_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The fast tokenizer of a GGUF's `tokenizer.ggml.*` metadata; ModelError for a kind we don't build."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
    tokens: Sequence[str] = meta["tokenizer.ggml.tokens"]
    kinds: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
    alphabet = frozenset(byte_alphabet().values())
    vocab = {_respell(token, alphabet): index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(str(meta.get("tokenizer.ggml.pre", "")))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) match whole and are special; one spelled outside
    # the byte alphabet is a mislabel of the converter and would not be in the model's vocabulary.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, k in zip(tokens, kinds, strict=True)
            if k == CONTROL and set(token) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, k in zip(tokens, kinds, strict=True)
            if k == USER_DEFINED and token in vocab
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], int(bos))]
        )
    return tokenizer


__all__ = ["PRE_TOKENIZER_SPLITS", "byte_alphabet", "gguf_tokenizer"]
