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
# o200k (GPT-4o's vocabulary, gpt-oss's o200k_harmony): a word keeps its leading capitals, its
# contraction, and one non-letter before it; digits in threes; "/" after punctuation stays with it
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "gpt-4o": _GPT4O,
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
    tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelError("GGUF file has no tokenizer.ggml.tokens")
    kinds: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tokenizer, spelled = _byte_level(meta, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tokenizer, spelled = _sentencepiece(meta, tokens), None
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for these
    else:
        raise ModelError(
            f"GGUF tokenizer model {kind!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
        )
    named = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    # Control tokens (<|im_start|>, </s>) and the named ones match whole and are special; in a
    # byte-level vocabulary one spelled outside the byte alphabet is a mislabel of the converter.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for index, (token, k) in enumerate(zip(tokens, kinds, strict=True))
            if (k == CONTROL or index in named) and (spelled is None or set(token) <= spelled)
        ]
    )
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, k in zip(tokens, kinds, strict=True)
            if k == USER_DEFINED and token in vocab
        ]
    )
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    with_bos = add_bos and bos is not None
    with_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and eos is not None
    if with_bos or with_eos:
        head = f"{tokens[int(bos)]} " if with_bos else ""
        tail = f" {tokens[int(eos)]}" if with_eos else ""
        ends = {tokens[int(i)]: int(i) for i, on in ((bos, with_bos), (eos, with_eos)) if on}
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B:1{tail}", special_tokens=list(ends.items())
        )
    return tokenizer


def _byte_level(meta: Mapping[str, Any], tokens: Sequence[str]) -> tuple[Tokenizer, frozenset[str]]:
    """A byte-level BPE: the file's merges, split as `tokenizer.ggml.pre` says, bytes decoded back."""
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
    return tokenizer, alphabet


def _sentencepiece(meta: Mapping[str, Any], tokens: Sequence[str]) -> Tokenizer:
    """A SentencePiece BPE (Llama 2, Mistral): pieces spelled with ▁, unknown characters as
    <0xXX> byte tokens, and merges from the file or, as SentencePiece files carry none, from the
    pieces' scores (a piece's splits into two pieces, best score first)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces, ranked
    by the piece's score (higher merges first), then by the lengths of its halves."""
    found = []
    for piece, score in scores.items():
        splits = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        found.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


__all__ = ["PRE_TOKENIZER_SPLITS", "byte_alphabet", "gguf_tokenizer", "merges_from_scores"]
