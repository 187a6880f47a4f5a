"""A classifier head's rows (`--task classify`, and `--task score`'s plain rows): a window's label
probabilities become `label` and `score` columns (and, with --all-scores, `scores`: every label's
probability in the checkpoint's label order); a cross-encoder's one value per row becomes `score`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..files.part_format import id_array
from ..files.parts import TableStore
from ..models.checkpoint import CheckpointInfo


def labels_table(
    ids: list[Any], values: np.ndarray, labels: tuple[str, ...], all_scores: bool, score: bool = False
) -> pa.Table:
    """ids + probabilities [rows, labels] -> id, label (the most probable), score (its probability);
    `score` (a cross-encoder's one value per row): id, score."""
    if score:
        return pa.table({"id": id_array(ids), "score": pa.array(values[:, 0] if len(values) else [], pa.float32())})
    best = values.argmax(axis=1) if len(values) else np.zeros(0, dtype=np.int64)
    columns = {
        "id": id_array(ids),
        "label": pa.array([labels[i] for i in best.tolist()], pa.string()),
        "score": pa.array(values[np.arange(len(values)), best] if len(values) else [], pa.float32()),
    }
    if all_scores:
        flat = pa.array(values.reshape(-1), type=pa.float32())
        columns["scores"] = pa.FixedSizeListArray.from_arrays(flat, len(labels))
    return pa.table(columns)


class LabelStore(TableStore):
    """Parts of classification rows: the writer's [rows, labels] values written as labels."""

    def __init__(self, output: str, fmt: str, info: CheckpointInfo, fp: dict[str, Any], all_scores: bool) -> None:
        super().__init__(output, fmt, info.output_dim, fp)
        self.labels: tuple[str, ...] = info.classifier.labels
        self.all_scores = all_scores
        self.score = info.classifier.score

    def table(self, ids: list[Any], values: np.ndarray) -> pa.Table:
        return labels_table(ids, values, self.labels, self.all_scores, self.score)


__all__ = ["LabelStore", "labels_table"]
