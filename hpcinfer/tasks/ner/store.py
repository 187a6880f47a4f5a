"""`--task ner` output rows: `id`, then per token (special tokens left out, as transformers'
token-classification pipeline leaves them out) its `tokens` text, its `labels` and their `scores`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from ...files.part_format import id_array
from ...files.table_store import TableStore
from ...models.checkpoint import CheckpointInfo
from .model import FIELDS


class TokenLabelStore(TableStore):
    """Parts of token-label rows, unpacked from the writer's packed [rows, 3 x max_length] values."""

    def __init__(self, output: str, fmt: str, info: CheckpointInfo, fp: dict[str, Any]) -> None:
        super().__init__(output, fmt, info.output_dim, fp)
        self.labels: tuple[str, ...] = info.head.labels
        tokenizer = Tokenizer.from_file(str(info.path / "tokenizer.json"))
        self.vocab = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
        self.special = np.array(sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special))

    def table(self, ids: list[Any], values: np.ndarray) -> pa.Table:
        tokens, labels, scores = [], [], []
        for row in values.reshape(len(values), self.dim // FIELDS, FIELDS):
            kept = row[(row[:, 0] >= 0) & ~np.isin(row[:, 2], self.special)]
            tokens.append([self.vocab.get(int(i), "") for i in kept[:, 2]])
            labels.append([self.labels[int(k)] for k in kept[:, 0]])
            scores.append(kept[:, 1].tolist())
        return pa.table(
            {
                "id": id_array(ids),
                "tokens": pa.array(tokens, pa.list_(pa.string())),
                "labels": pa.array(labels, pa.list_(pa.string())),
                "scores": pa.array(scores, pa.list_(pa.float32())),
            }
        )
