"""Long texts cut before they are tokenized, to what truncation keeps: `TextCutter`.

Why: a tokenizer reads the whole text before truncation drops all but the first max_length
tokens; a 5 MB row takes 5-6 s of one core (~1 us a character) to keep 256 tokens, and a corpus of
20 KB documents spends more time tokenizing than an accelerator spends running the model. So a text
longer than `budget_chars` is tokenized from a prefix of it instead.

Exact, not approximate. The prefix ends where a run of spaces (U+0020) begins. A tokenizer
qualifies only where every word before that point keeps its tokens whatever follows it:
- its pre-tokenizer splits at every space (BERT's, Whitespace, WhitespaceSplit, byte-level BPE
  with its own regex, SentencePiece's Metaspace split at spaces, or a Split by one of the regexes
  `KNOWN_SPLITS` names, as Llama 3's and Qwen's are built), and no step before it rewrites spaces;
  steps after it only split further;
- its normalizer maps characters where they stand and never removes or joins across a space
  (`_LOCAL`; a Replace only of a literal without whitespace, or of space runs by one space);
- no added token holds a space between other characters.
Other whitespace (tabs, form feeds, U+001C-U+001F, U+0085) is not taken for a word's end: some
normalizers delete it and some pre-tokenizers do not split at it. What is kept is then checked on
each cut row: the prefix must overflow max_length, and every kept token must end before the
prefix's last word (the one word whose tokens the cut may change). A row that fails the check is
tokenized whole, as is every row of a tokenizer that does not qualify, of a pair (--task score:
truncating the longer side first depends on both lengths) and of truncation that keeps a text's
end or a stride.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

from ..models.gguf_tokenizer import PRE_TOKENIZER_SPLITS

CHARS_PER_TOKEN = 8  # the prefix's length per token kept: ~2x what English (4-5) and code (3) take
MIN_BUDGET_CHARS = 4096
# pre-tokenizers that split at every space; the ones that only split further, wherever they stand
_SPLIT_AT_SPACES = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_FURTHER = {"Punctuation", "Digits", "UnicodeScripts", "CharDelimiterSplit"}
# Llama 3's, Qwen 2's and GPT-4o's splits: a piece holds a space only first or in a run of whitespace
KNOWN_SPLITS = frozenset(PRE_TOKENIZER_SPLITS.values())
# normalizers that map each character (or a short run of them) where it stands
_LOCAL = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip", "Prepend"}
_LOCAL |= {"Precompiled", "Nmt"}
_SPACES_START = re.compile(r"(?<=[^ ]) ")  # a run of spaces, where it begins


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
        if not _local_normalizer(_state(tokenizer.normalizer)) or not _splits_words(_state(tokenizer.pre_tokenizer)):
            return None
        for added in tokenizer.get_added_tokens_decoder().values():
            if " " in added.content.strip(" "):  # NOTE: a token spanning words could span the cut
                return None
        return cls(max(MIN_BUDGET_CHARS, CHARS_PER_TOKEN * max_length))

    def cut(self, texts: list[str]) -> dict[int, str]:
        """{index: prefix} of the texts longer than the budget with a space between it and twice it
        (past that, a prefix would save little and could cost a second tokenization)."""
        cuts = {}
        for i, text in enumerate(texts):
            if len(text) > self.budget_chars:
                found = _SPACES_START.search(text, self.budget_chars, 2 * self.budget_chars)
                if found is not None:
                    cuts[i] = text[: found.start()]
        return cuts

    @staticmethod
    def kept_before_cut(encoding: Any, prefix: str) -> bool:
        """Whether truncation cut the prefix's tokens (the prefix has more than max_length) and every
        token kept ends before the prefix's last word, so the whole text keeps the same ones.

        NOTE: special tokens count too: one written in the text has the text's offsets (a template's
        own have none)."""
        if not encoding.overflowing:
            return False
        last_space = prefix.rfind(" ")
        if last_space < 0:  # NOTE: a prefix of one word: nothing is known to be unchanged
            return False
        last_word = len(prefix[:last_space].rstrip(" "))  # where the spaces before the last word begin
        return max((end for _, end in encoding.offsets), default=0) <= last_word


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's own description (its JSON in tokenizer.json), or None."""
    if component is None:
        return None
    try:
        return json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return {"type": "unknown"}


def _local_normalizer(state: dict[str, Any] | None) -> bool:
    """No normalizer, or one whose every step maps characters where they stand (module docstring)."""
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_local_normalizer(step) for step in state.get("normalizers", []))
    if kind == "Replace":
        pattern, content = state.get("pattern") or {}, str(state.get("content", ""))
        if pattern == {"Regex": " {2,}"} and content == " ":  # space runs as one space (XLM-R's)
            return True
        literal = pattern.get("String")
        return bool(literal) and not any(c.isspace() for c in str(literal) + content)
    return kind in _LOCAL


def _splits_words(state: dict[str, Any] | None) -> bool:
    """A pre-tokenizer that splits at every space, with no step before that rewriting spaces and only
    splitting steps after it (module docstring)."""
    if state is None:
        return False  # NOTE: the whole text one piece: a model's tokens could then span a space
    steps = state.get("pretokenizers", []) if state.get("type") == "Sequence" else [state]
    split = False
    for step in steps:
        if _splits_at_spaces(step):
            split = True
        elif step.get("type") in _FURTHER or (split and step.get("type") == "ByteLevel"):
            continue  # NOTE: ByteLevel without its regex, after the split, only spells each piece's bytes
        else:
            return False
    return split


def _splits_at_spaces(step: dict[str, Any]) -> bool:
    kind = step.get("type")
    if kind == "ByteLevel":
        return bool(step.get("use_regex", True))
    if kind == "Metaspace":
        return step.get("split", True) is not False
    if kind == "Split":
        regex = (step.get("pattern") or {}).get("Regex")
        return step.get("behavior") == "Isolated" and regex in KNOWN_SPLITS
    return kind in _SPLIT_AT_SPACES
