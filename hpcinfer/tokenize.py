"""Stage 2, tokenize: RowBlocks -> TokenBlocks (flat int32 ids + lengths).

Uses the model's own fast tokenizer (Rust, releases the GIL), truncating exactly as
sentence-transformers does; pre-tokenized rows are only truncated.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain

import numpy as np
from tokenizers import Tokenizer

from .types import RowBlock, TokenBlock


def truncate_flat(flat: np.ndarray, lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Cuts every row of a flat (ids, lengths) pair to max_length tokens."""
    over = lengths > max_length
    if not over.any():
        return flat, lengths, 0
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    new_lengths = np.minimum(lengths, max_length).astype(np.int32)
    keep = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, new_lengths, strict=True)])
    return flat[keep], new_lengths, int(over.sum())


class TokenizeStage:
    """Consumes RowBlock, produces TokenBlock. Stateless, so several may run concurrently."""

    name = "tokenize"

    def __init__(self, tokenizer: Tokenizer, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length

    def process(self, block: RowBlock) -> Iterator[TokenBlock]:
        if block.token_ids is not None:
            flat, lengths, truncated = truncate_flat(*block.token_ids, self.max_length)
        else:
            assert block.texts is not None
            encodings = self.tokenizer.encode_batch(block.texts, add_special_tokens=True)
            lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int32, count=len(encodings))
            flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=int(lengths.sum()))
            truncated = sum(1 for e in encodings if e.overflowing)
        yield TokenBlock(block.block_id, block.first_row, block.ids, flat, lengths, truncated)

    def finish(self) -> Iterator[TokenBlock]:
        return iter(())
