"""`--task ner` output rows: `id`, then per token (special tokens left out, as transformers'
token-classification pipeline leaves them out) its `tokens` text, its `labels` and their `scores`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from ...files.part_format import id_array
from ...files.parts import TableStore
from ...models.checkpoint import CheckpointInfo
from ...values import Ragged


class TokenLabelStore(TableStore):
    """Parts of token-label rows, from each row's tokens' label, score and token id (ragged items)."""

    def __init__(self, output: str, fmt: str, info: CheckpointInfo, fp: dict[str, Any]) -> None:
        super().__init__(output, fmt, info.output_dim, fp)
        self.ragged = info.ragged
        self.labels = np.array(info.head.labels, dtype=object)
        tokenizer = Tokenizer.from_file(str(info.path / "tokenizer.json"))
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab = np.full(max(vocab.values(), default=-1) + 1, "", dtype=object)  # token id -> its text
        self.vocab[list(vocab.values())] = list(vocab)
        self.special = np.array(sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special))

    def table(self, ids: list[Any], values: Ragged) -> pa.Table:
        token = values.fields["token"]
        keep = ~np.isin(token, self.special)
        rows = np.repeat(np.arange(len(values)), values.counts)
        counts = np.bincount(rows[keep], minlength=len(values))
        offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32), pa.int32())
        known = np.where(token < len(self.vocab), token, 0)
        texts = np.where(token < len(self.vocab), self.vocab[known], "")[keep].tolist()
        labels = self.labels[values.fields["label"][keep]].tolist()

        def listed(items: pa.Array) -> pa.Array:
            return pa.ListArray.from_arrays(offsets, items)

        return pa.table(
            {
                "id": id_array(ids),
                "tokens": listed(pa.array(texts, pa.string())),
                "labels": listed(pa.array(labels, pa.string())),
                "scores": listed(pa.array(values.fields["score"][keep], pa.float32())),
            }
        )
