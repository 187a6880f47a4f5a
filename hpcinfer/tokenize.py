"""Stage 2, tokenize: RowBlocks -> TokenBlocks (flat int32 ids + lengths).

Uses the model's own fast tokenizer (Rust, releases the GIL), truncating exactly as
sentence-transformers does. Pre-tokenized rows are checked against the vocabulary. A row longer
than max_length is truncated (and counted) or, with on_long="reject", set aside.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain

import numpy as np
from tokenizers import Tokenizer

from .types import Reject, RowBlock, TokenBlock


class TokenizeStage:
    """Consumes RowBlock, produces TokenBlock. Stateless, so several may run concurrently."""

    name = "tokenize"

    def __init__(self, tokenizer: Tokenizer, max_length: int, vocab_size: int, on_long: str = "truncate") -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.on_long = on_long

    def process(self, block: RowBlock) -> Iterator[TokenBlock]:
        if block.token_ids is not None:
            per_row, lengths = self._split_tokens(*block.token_ids)
            bad = self._bad_token_rows(per_row)
        else:
            assert block.texts is not None
            encodings = self.tokenizer.encode_batch(block.texts, add_special_tokens=True)
            per_row = [e.ids for e in encodings]
            lengths = np.fromiter((len(e.ids) + _overflow(e) for e in encodings), np.int64, len(encodings))
            bad = {}
        keep = [i for i in range(len(per_row)) if i not in bad]
        too_long = [i for i in keep if lengths[i] > self.max_length]
        rejects = list(block.rejects)
        if self.on_long == "reject":
            for i in too_long:
                bad[i] = ("too_long", f"longer than --max-length {self.max_length} tokens")
            keep = [i for i in keep if i not in bad]
        for i, (reason, message) in sorted(bad.items()):
            rejects.append(Reject(block.rows[i], block.source, block.lines[i], block.ids[i], reason, message))
        rows = [per_row[i][: self.max_length] for i in keep]
        out_lengths = np.fromiter((len(r) for r in rows), np.int32, len(rows))
        flat = np.fromiter(chain.from_iterable(rows), np.int32, int(out_lengths.sum()))
        truncated = 0 if self.on_long == "reject" else len(too_long)
        ids = [block.ids[i] for i in keep]
        rows_kept = np.asarray(block.rows, dtype=np.int64)[keep] if keep else np.empty(0, np.int64)
        yield TokenBlock(
            block.block_id,
            block.first_row,
            block.input_rows,
            ids,
            flat,
            out_lengths,
            truncated,
            rejects,
            rows_kept,
            block.source,
        )

    @staticmethod
    def _split_tokens(flat: np.ndarray, lengths: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else [], lengths.astype(np.int64)

    def _bad_token_rows(self, rows: list[np.ndarray]) -> dict[int, tuple[str, str]]:
        bad = {}
        for i, row in enumerate(rows):
            if len(row) and (row.min() < 0 or row.max() >= self.vocab_size):
                value = int(row.min()) if row.min() < 0 else int(row.max())
                bad[i] = ("invalid_token_ids", f"token id {value} is outside the vocabulary [0, {self.vocab_size})")
        return bad

    def finish(self) -> Iterator[TokenBlock]:
        return iter(())


def _overflow(encoding: object) -> int:
    """A truncated encoding keeps the cut tokens in `overflowing`; 1 marks it as too long."""
    return 1 if encoding.overflowing else 0  # type: ignore[attr-defined]
