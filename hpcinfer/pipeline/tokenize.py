"""Stage 2, tokenize: RowBlocks -> TokenBlocks (flat int32 ids + lengths).

Uses the model's own fast tokenizer (Rust, releases the GIL), truncating exactly as
sentence-transformers does; a text far longer than max_length is tokenized from the prefix that
keeps the same tokens (long_text.py). Pre-tokenized rows are checked against the vocabulary. A row
longer than max_length is truncated (and counted) or, with on_long="reject", set aside.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..types import Reject, RowBlock
from .fanout import whole_requests
from .long_text import TextCutter
from .types import TokenBlock


class TokenizeStage:
    """Consumes RowBlock, produces TokenBlock. Stateless, so several may run concurrently."""

    name = "tokenize"

    def __init__(
        self, tokenizer: Tokenizer, max_length: int, vocab_size: int, on_long: str = "truncate", prompt: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.on_long = on_long
        # Put before every text (--prompt); it counts toward max_length, as in sentence-transformers.
        self.prompt = prompt
        self.cutter = TextCutter.for_tokenizer(tokenizer, max_length)

    def process(self, block: RowBlock) -> Iterator[TokenBlock]:
        """Flat numpy arrays all the way: no per-token Python objects (they would fragment the heap)."""
        if block.token_ids is not None:
            flat, lengths = block.token_ids
            too_long = lengths > self.max_length
            bad = self._bad_token_rows(flat, lengths)
        else:
            assert block.texts is not None
            encodings, bad = self._encode(block.texts, block.prompts)
            lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
            flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), np.int64, int(lengths.sum()))
            too_long = np.fromiter((bool(e.overflowing) for e in encodings), bool, len(encodings))
        if self.on_long == "reject":
            for i in np.flatnonzero(too_long):
                bad.setdefault(int(i), ("too_long", f"longer than --max-length {self.max_length} tokens"))
        # NOTE: a bad part of a request rejects the request, once; its other parts go with it
        bad, drop = whole_requests(bad, block.rows, block.options)
        rejects = list(block.rejects)
        for i, (reason, message) in sorted(bad.items()):
            row = block.rows[i]
            rejects.append(
                Reject(row, block.source, block.lines[i], block.ids[i], reason, message, row - block.file_first_row)
            )
        keep = np.ones(len(lengths), dtype=bool)
        keep[list(drop)] = False
        # Truncation (pre-tokenized rows; the tokenizer truncates text itself) as a token mask.
        starts = np.cumsum(lengths) - lengths
        position = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
        token_keep = np.repeat(keep, lengths) & (position < self.max_length)
        out_lengths = np.minimum(lengths[keep], self.max_length).astype(np.int32)
        truncated = 0 if self.on_long == "reject" else int((too_long & keep).sum())
        ids = [block.ids[i] for i in np.flatnonzero(keep)] if drop else block.ids
        rows = np.asarray(block.rows, dtype=np.int64)[keep]
        arrivals = block.arrival_ns[keep] if block.arrival_ns is not None else None
        yield TokenBlock(
            block.block_id,
            block.first_row,
            block.input_rows,
            ids,
            flat[token_keep].astype(np.int32),
            out_lengths,
            truncated,
            rejects,
            rows,
            block.source,
            arrivals,
            block.file_first_row,
            [block.options[i] for i in np.flatnonzero(keep)] if block.options is not None else None,
        )

    def _encode(
        self, texts: list[str], prompts: list[str | None] | None = None
    ) -> tuple[list[Any], dict[int, tuple[str, str]]]:
        """Encodings of every text (a long one from its prefix where that keeps the same tokens); a text
        the tokenizer refuses becomes a reject, not a failed run."""
        if texts and isinstance(texts[0], list):  # text pairs (--task score): the tokenizer's pair template
            texts = [tuple(pair) for pair in texts]
        elif prompts is not None:  # NOTE: a row's own prompt replaces the run's
            texts = [(self.prompt if p is None else p) + text for p, text in zip(prompts, texts, strict=True)]
        elif self.prompt:
            texts = [self.prompt + text for text in texts]
        cuts = self.cutter.cut(texts) if self.cutter is not None and texts and isinstance(texts[0], str) else {}
        if not cuts:
            return self._encode_all(texts)
        encodings, bad = self._encode_all([cuts.get(i, text) for i, text in enumerate(texts)])
        # NOTE: a cut row the check cannot vouch for, or one the tokenizer refused, is tokenized whole
        whole = [i for i, prefix in cuts.items() if i in bad or not self.cutter.kept_before_cut(encodings[i], prefix)]
        if whole:
            again, bad_again = self._encode_all([texts[i] for i in whole])
            for j, i in enumerate(whole):
                encodings[i] = again[j]
                bad.pop(i, None)
                if j in bad_again:
                    bad[i] = bad_again[j]
        return encodings, bad

    def _encode_all(self, texts: list[Any]) -> tuple[list[Any], dict[int, tuple[str, str]]]:
        """NOTE: one failing text fails the whole batch call, so only then is the block encoded row by
        row (a refused row stands in as the encoding of "", and is dropped with the rejects)."""
        try:
            return self.tokenizer.encode_batch(texts, add_special_tokens=True), {}
        except Exception:  # noqa: BLE001 - the tokenizer's own error types are not public
            pass
        encodings: list[Any] = []
        bad: dict[int, tuple[str, str]] = {}
        for i, text in enumerate(texts):
            try:
                pair = (text,) if isinstance(text, str) else tuple(text)
                encodings.append(self.tokenizer.encode(*pair, add_special_tokens=True))
            except Exception as exc:  # noqa: BLE001
                bad[i] = ("tokenize_error", f"the tokenizer refused this text ({type(exc).__name__}: {exc})")
                encodings.append(self.tokenizer.encode("", add_special_tokens=True))
        return encodings, bad

    def _bad_token_rows(self, flat: np.ndarray, lengths: np.ndarray) -> dict[int, tuple[str, str]]:
        """Rows of pre-tokenized ids with a negative or out-of-vocabulary id."""
        if not len(lengths):
            return {}
        starts = np.cumsum(lengths) - lengths
        lows = np.minimum.reduceat(flat, starts)
        highs = np.maximum.reduceat(flat, starts)
        bad = {}
        for i in np.flatnonzero((lows < 0) | (highs >= self.vocab_size)):
            value = int(lows[i]) if lows[i] < 0 else int(highs[i])
            bad[int(i)] = ("invalid_token_ids", f"token id {value} is outside the vocabulary [0, {self.vocab_size})")
        return bad

    def finish(self) -> Iterator[TokenBlock]:
        return iter(())
