"""Long texts cut before they are tokenized, to what truncation keeps: `TextCutter`.

Why: a tokenizer reads the whole text before truncation drops all but the first max_length
tokens; a 5 MB row takes ~5 s of one core (1 us a character) to keep 256 tokens, and a corpus of
20 KB documents spends more time tokenizing than an accelerator spends running the model. So a text
longer than `budget_chars` is tokenized from a prefix of it instead.

Exact, not approximate: the prefix ends where a run of whitespace begins, and tokenizers whose
normalizer and pre-tokenizer are known to split at whitespace and look no further (BERT's WordPiece,
byte-level BPE with its regex, SentencePiece's Metaspace, their usual normalizers; `_SPLITTERS`,
`_LOCAL`) give the pre-words before that point the same tokens either way. What is kept is checked
on each cut row: the prefix must overflow max_length, and every kept token must end before the
prefix's last word (the one pre-word whose tokens the cut may change). A row that fails the check
is tokenized whole, as is every row of a tokenizer not known to qualify, of a pair (--task score:
truncating the longer side first depends on both lengths) and of truncation that keeps a text's
end or a stride.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

CHARS_PER_TOKEN = 8  # the prefix's length per token kept: ~2x what English (4-5) and code (3) take
MIN_BUDGET_CHARS = 4096
# pre-tokenizers that split a text at whitespace, and the ones that only split further
_SPLITTERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "ByteLevel", "Metaspace", "Split"}
_FURTHER = {"Punctuation", "Digits", "UnicodeScripts", "CharDelimiterSplit"}
# normalizers that map each character (or a short run of them) on its own
_LOCAL = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip", "Replace"}
_LOCAL |= {"Prepend", "Precompiled", "Nmt"}
_WORD_START = re.compile(r"(?<=\S)\s")  # a run of whitespace, where it begins
_LAST_WORD = re.compile(r"\s+\S+$")  # the last word of a text ending in one, with the whitespace before it


class TextCutter:
    """Cuts texts to what keeps max_length tokens (`cut`); says whether a cut row's tokens are the
    whole text's (`kept_before_cut`)."""

    def __init__(self, budget_chars: int) -> None:
        self.budget_chars = budget_chars

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, max_length: int) -> TextCutter | None:
        """A cutter where the tokenizer qualifies (module docstring), else None: every text whole."""
        truncation = tokenizer.truncation
        if not truncation or truncation.get("direction", "right") != "right" or truncation.get("stride", 0):
            return None
        if not _qualifies(_state(tokenizer.normalizer), _LOCAL, "normalizers"):
            return None
        pre = _state(tokenizer.pre_tokenizer)
        if pre is None or not _splits_at_whitespace(pre) or not _qualifies(pre, _SPLITTERS | _FURTHER, "pretokenizers"):
            return None
        return cls(max(MIN_BUDGET_CHARS, CHARS_PER_TOKEN * max_length))

    def cut(self, texts: list[str]) -> dict[int, str]:
        """{index: prefix} of the texts longer than the budget that have whitespace past it."""
        cuts = {}
        for i, text in enumerate(texts):
            if len(text) > self.budget_chars:
                found = _WORD_START.search(text, self.budget_chars)
                if found is not None:
                    cuts[i] = text[: found.start()]
        return cuts

    @staticmethod
    def kept_before_cut(encoding: Any, prefix: str) -> bool:
        """Whether truncation cut the prefix's tokens (the prefix has more than max_length) and every
        token kept ends before the prefix's last word, so the whole text keeps the same ones."""
        if not encoding.overflowing:
            return False
        last_word = _LAST_WORD.search(prefix)
        if last_word is None:  # NOTE: a prefix of one word: nothing is known to be unchanged
            return False
        ends = [
            end for (_, end), special in zip(encoding.offsets, encoding.special_tokens_mask, strict=True) if not special
        ]
        return not ends or max(ends) <= last_word.start()


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's own description (its JSON in tokenizer.json), or None."""
    if component is None:
        return None
    try:
        return json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return {"type": "unknown"}


def _qualifies(state: dict[str, Any] | None, known: set[str], key: str) -> bool:
    """Every step of a (Sequence of) normalizer(s) or pre-tokenizer(s) is one of `known`."""
    if state is None:
        return True
    if state.get("type") == "Sequence":
        return all(_qualifies(step, known, key) for step in state.get(key, []))
    if state.get("type") == "Metaspace" and state.get("split") is False:
        return False  # NOTE: the whole text one piece: SentencePiece's pieces could then span a space
    return state.get("type") in known


def _splits_at_whitespace(state: dict[str, Any]) -> bool:
    """Some step splits the text at whitespace (ByteLevel only with its own regex)."""
    if state.get("type") == "Sequence":
        return any(_splits_at_whitespace(step) for step in state.get("pretokenizers", []))
    if state.get("type") == "ByteLevel":
        return bool(state.get("use_regex", True))
    if state.get("type") == "Split":
        # NOTE: a regex that isolates runs of whitespace, as GPT-2's, Llama 3's and Qwen's do; any other
        # pattern may leave words joined, and BPE's merges may then reach across the cut
        pattern = state.get("pattern", {})
        return state.get("behavior") == "Isolated" and "\\s+" in str(pattern.get("Regex", ""))
    return state.get("type") in _SPLITTERS
