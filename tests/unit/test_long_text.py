"""Long texts tokenized from a prefix (pipeline/long_text.py) keep exactly the tokens the whole text
keeps: the oracle is the same tokenizer, truncating, on every whole text."""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import pytest
from tokenizers import (
    AddedToken,
    Regex,
    SentencePieceUnigramTokenizer,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from hpcinfer.models.registry import load_tokenizer, resolve_model_path
from hpcinfer.pipeline.long_text import KNOWN_SPLITS, TextCutter
from hpcinfer.pipeline.tokenize import TokenizeStage
from hpcinfer.types import RowBlock

WORDS = "the quick brown fox jumps over lazy dog naïve café Ünïcode — “quotes” don't 3.14159 x=y+1; {key: [1, 2]}"
WORDS = WORDS.split() + ["東京", "你好世界", "😀", "🇫🇷", "ﬁne", "e\u0301", "<|endoftext|>", "[SEP]", "\\n", "ab" * 80]
GAPS = [" "] * 12 + ["  ", "\n", "\n\n", "\t", " \u00a0 ", "   \n  ", "\x0c", "\x1c", "\x85", "\x0b", "\u3000"]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"  # Llama 3's split
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        piece = rng.choice(WORDS) + rng.choice(GAPS)
        out.append(piece)
        size += len(piece)
    return "".join(out)


def texts(seed: int) -> list[str]:
    """Short rows, long rows (past every budget), and long rows the cut cannot help: a 6 KB first
    word, whitespace only at the start, words that are one unknown token each."""
    rng = random.Random(seed)
    rows = [text(rng, rng.choice([10, 200, 3000, 5000, 7000, 12000])) for _ in range(32)]
    rows += ["z" * 6000 + " tail words", "  lead " + "q" * 5000, " ".join(["Ω" * 120] * 50), "word " * 1500]
    rows += ["", " ", "x" * 9000, "end " * 1200 + "\n" * 1000]
    rng.shuffle(rows)
    return rows


def corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [text(rng, 1000) for _ in range(60)]


def _trained(model: models.Model, pre_tokenizer: pre_tokenizers.PreTokenizer, trainer: trainers.Trainer) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.train_from_iterator(corpus(1), trainer)
    return tokenizer


def byte_level() -> Tokenizer:
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return _trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), trainer)


def split_then_bytes() -> Tokenizer:
    """Llama 3 / Qwen: a regex split, then bytes without ByteLevel's own regex."""
    tokenizer = byte_level()
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(use_regex=False)])
    return tokenizer


def unigram() -> Tokenizer:
    """XLM-R's kind: SentencePiece's Unigram behind a Metaspace split at spaces (and NMT/NFKC normalizing)."""
    tokenizer = SentencePieceUnigramTokenizer()
    tokenizer.train_from_iterator(corpus(2), vocab_size=300, show_progress=False, unk_token="<unk>")
    return tokenizer._tokenizer


def wordpiece(max_length: int) -> Tokenizer:
    return load_tokenizer(resolve_model_path("default"), max_length)


TOKENIZERS = {"wordpiece": None, "byte-level": byte_level, "split-then-bytes": split_then_bytes, "unigram": unigram}


@functools.cache
def _trained_once(name: str) -> str:
    return TOKENIZERS[name]().to_str()


def _truncating(name: str, max_length: int) -> Tokenizer:
    tokenizer = wordpiece(max_length) if name == "wordpiece" else Tokenizer.from_str(_trained_once(name))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    return tokenizer


def _tokenized(stage: TokenizeStage, rows: list[str], prompt_rows: list[str | None] | None = None):
    n = len(rows)
    ids = [str(i) for i in range(n)]
    block = RowBlock(0, 0, n, "f", ids, texts=rows, prompts=prompt_rows, rows=list(range(n)), lines=[None] * n)
    (tokens,) = list(stage.process(block))
    starts = np.cumsum(tokens.lengths) - tokens.lengths
    return [tokens.flat_ids[s : s + k].tolist() for s, k in zip(starts, tokens.lengths, strict=True)], tokens.truncated


@pytest.mark.parametrize(
    ("name", "max_length"),
    [("wordpiece", 128), ("wordpiece", 512), ("byte-level", 128), ("split-then-bytes", 512), ("unigram", 128)],
)
def test_long_rows_keep_the_tokens_of_the_whole_text(name, max_length):
    tokenizer = _truncating(name, max_length)
    stage = TokenizeStage(tokenizer, max_length, tokenizer.get_vocab_size(), prompt="query: ")
    assert stage.cutter is not None, "a tokenizer that splits at whitespace is cut"
    rows = texts(7)
    whole = tokenizer.encode_batch(["query: " + row for row in rows])
    got, truncated = _tokenized(stage, rows)
    assert got == [e.ids for e in whole]
    assert truncated == sum(bool(e.overflowing) for e in whole) > 10
    # the rows the cut could not vouch for were tokenized whole, as they must be (a cut at the budget
    # keeps too few tokens of these: the oracle above would see it)
    cuts = stage.cutter.cut(["query: " + row for row in rows])
    cut_encodings = tokenizer.encode_batch(list(cuts.values()))
    vouched = [TextCutter.kept_before_cut(e, prefix) for e, prefix in zip(cut_encodings, cuts.values(), strict=True)]
    assert sum(vouched) >= 10 and not all(vouched)


def test_a_rows_own_prompt_is_cut_with_its_text():
    tokenizer = _truncating("wordpiece", 128)
    stage = TokenizeStage(tokenizer, 128, tokenizer.get_vocab_size())
    rows = texts(11)[:20]
    prompts: list[str | None] = [None if i % 2 else "passage: " for i in range(len(rows))]
    whole = tokenizer.encode_batch([(p or "") + row for p, row in zip(prompts, rows, strict=True)])
    assert _tokenized(stage, rows, prompts)[0] == [e.ids for e in whole]


def _bpe(separator: str) -> Tokenizer:
    """A BPE whose merges chain right to left across `separator`: "c" after a cut would change the
    token of the "a" before it, were the pieces joined there."""
    tokens = ["[UNK]", "a", "b", "c", "d", " ", "\u2581", separator, separator + "c", "b" + separator + "c"]
    tokens += [separator + "b" + separator + "c", "a" + separator + "b" + separator + "c"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    merges = [(separator, "c"), ("b", separator + "c"), (separator, "b" + separator + "c")]
    merges.append(("a", separator + "b" + separator + "c"))
    return Tokenizer(models.BPE(vocab, merges, unk_token="[UNK]", fuse_unk=True))


def _kept_to_a(tokenizer: Tokenizer, separator: str) -> tuple[str, int]:
    """A row whose cut lands right after "b" (the prefix's last word is separator + "b") and the
    max_length that keeps the tokens up to "a", which end exactly where that last word starts."""
    row = "x" * 4093 + " a" + separator + "b" + separator + "c d"
    offsets = tokenizer.encode(row[:4097]).offsets
    return row, next(i for i, span in enumerate(offsets) if span == (4094, 4095)) + 1


@pytest.mark.parametrize(
    ("separator", "pre_tokenizer"),
    [
        ("\x1c", pre_tokenizers.WhitespaceSplit()),
        ("\n", pre_tokenizers.Metaspace()),
        ("\t", pre_tokenizers.Whitespace()),
    ],
    ids=["file-separator", "newline-metaspace", "tab"],
)
def test_whitespace_other_than_spaces_is_no_place_to_cut(separator, pre_tokenizer):
    """Python's whitespace these pre-tokenizers do not split at: taken for a word's end, the cut
    would change the kept "a"."""
    tokenizer = _bpe(separator)
    tokenizer.pre_tokenizer = pre_tokenizer
    row, max_length = _kept_to_a(tokenizer, separator)
    tokenizer.enable_truncation(max_length)
    stage = TokenizeStage(tokenizer, max_length, tokenizer.get_vocab_size())
    assert stage.cutter is not None
    assert _tokenized(stage, [row])[0] == [tokenizer.encode(row).ids]


def test_a_form_feed_inside_a_word_keeps_the_word_for_bert():
    """BERT's normalizer deletes a form feed: "gene\\x0cr\\x0cal" is the word "general"."""
    tokenizer = wordpiece(128)
    stage = TokenizeStage(tokenizer, 128, tokenizer.get_vocab_size())
    filler = "x " * 106 + ("a" * 200 + " ") * 18  # 124 tokens: "a" * 200 is one [UNK]
    filler += "a" * (4091 - len(filler) - 1) + " "  # the 125th; "gene" starts at 4091
    row = filler + "gene\x0cr\x0cal and more words"
    whole = tokenizer.encode(row)
    assert tokenizer.id_to_token(whole.ids[-2]) == "general"
    assert _tokenized(stage, [row])[0] == [whole.ids]


def _with(pre_tokenizer: Any = None, normalizer: Any = None, added: str = "") -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "abc": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizer if pre_tokenizer is not None else pre_tokenizers.WhitespaceSplit()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if added:
        tokenizer.add_tokens([AddedToken(added, normalized=False)])
    return tokenizer


def test_tokenizers_that_may_join_words_are_never_cut():
    known = LLAMA3_SPLIT
    bytes_first = [pre_tokenizers.ByteLevel(use_regex=False), pre_tokenizers.Split(Regex(known), "isolated")]
    joining = [
        _with(pre_tokenizers.Metaspace(split=False)),  # SentencePiece BPE as GGUF's llama kind builds it
        _with(pre_tokenizers.Split(Regex(r"\n"), behavior="isolated")),  # words joined within a line
        _with(pre_tokenizers.Split(Regex(r"(?:\S+\s+){0,3}\S+"), behavior="isolated")),  # up to four words a piece
        _with(pre_tokenizers.Sequence(bytes_first)),  # spaces spelled as bytes before the split sees them
        _with(normalizer=normalizers.Replace("a b c", "abc")),
        _with(normalizer=normalizers.Replace("\t", "")),  # tabs deleted: "a\tb" one word
        _with(normalizer=normalizers.Replace(Regex(r"\s+"), "")),
        _with(added="a b c"),
        Tokenizer(models.BPE()),  # no pre-tokenizer: the whole text one piece
    ]
    for tokenizer in joining:
        tokenizer.enable_truncation(64)
        assert TextCutter.for_tokenizer(tokenizer, 64) is None, tokenizer.to_str()[:300]
    kept_end = _truncating("byte-level", 64)
    kept_end.enable_truncation(64, direction="left")
    assert TextCutter.for_tokenizer(kept_end, 64) is None
    split = _with(pre_tokenizers.Sequence(bytes_first[::-1]))
    split.enable_truncation(64)
    assert known in KNOWN_SPLITS and TextCutter.for_tokenizer(split, 64) is not None
    assert TextCutter.for_tokenizer(_truncating("unigram", 64), 64) is not None


def test_a_five_megabyte_row_is_tokenized_from_its_prefix():
    tokenizer = _truncating("wordpiece", 256)
    stage = TokenizeStage(tokenizer, 256, tokenizer.get_vocab_size())
    row = "word and more words, " * 250_000
    calls: list[int] = []
    encode_batch = tokenizer.encode_batch

    class Counting:
        """Records the longest text each call tokenizes."""

        truncation = tokenizer.truncation

        def encode_batch(self, batch, add_special_tokens=True):
            calls.append(max(map(len, batch)))
            return encode_batch(batch, add_special_tokens=add_special_tokens)

    stage.tokenizer = Counting()
    got, truncated = _tokenized(stage, [row, "short"])
    assert len(calls) == 1 and calls[0] < 2 * stage.cutter.budget_chars and truncated == 1
    # the text repeats itself: its first 256 tokens are those of its first 100 KB, tokenized whole
    assert got[0] == tokenizer.encode(row[:100_000]).ids
