"""The tuning sample: N rows of the user's own input, stratified over token length.

Batch shapes depend on the length mix, so the sample must keep it: rows are ordered by token
length, cut into N equal strata and one row is drawn from each (seeded), then put back in input
order. A sample taken from the head of a file would miss a length mix that drifts along it, so
up to `scan_rows` rows are read first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import RunConfig
from ..errors import InputError
from ..files.parts import id_array
from ..files.read import Reader
from ..models.registry import load_tokenizer
from ..tasks.embed.options import embed_checkpoint


@dataclass(slots=True)
class Sample:
    path: Path
    rows: int
    scanned: int
    lengths: np.ndarray  # token lengths of the sampled rows
    scanned_lengths: np.ndarray

    def describe(self) -> str:
        def pct(a: np.ndarray) -> str:
            return "/".join(str(int(v)) for v in np.percentile(a, [10, 50, 90]))

        return (
            f"{self.rows:,} of {self.scanned:,} rows, stratified over token length "
            f"(p10/p50/p90: {pct(self.lengths)} tokens; scanned rows: {pct(self.scanned_lengths)})"
        )


def stratified_indices(lengths: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Indices of n rows, one from each of n equal strata of the length-sorted rows, in input order."""
    total = len(lengths)
    if n >= total:
        return np.arange(total)
    order = np.argsort(lengths, kind="stable")
    rng = np.random.default_rng(seed)
    picks = ((np.arange(n) + rng.random(n)) * total / n).astype(np.int64)
    return np.sort(order[np.minimum(picks, total - 1)])


def draw_sample(config: RunConfig, n: int, seed: int, out_path: Path, scan_rows: int) -> Sample:
    info = embed_checkpoint(config)
    max_length = config.tokenize.max_length or info.max_seq_length
    tokenizer = load_tokenizer(info.path, max_length)
    reader = Reader(replace(config.input, limit=scan_rows, rate=None), window_rows=max(scan_rows, 1))
    ids: list[Any] = []
    texts: list[str] = []
    tokens: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for block in reader.produce():
        ids.extend(block.ids)
        if block.texts is not None:
            texts.extend(block.texts)
            inputs = [tuple(t) if isinstance(t, list) else t for t in block.texts]  # text pairs (--task score)
            encoded = tokenizer.encode_batch(inputs, add_special_tokens=True)
            lengths.append(np.fromiter((len(e.ids) for e in encoded), np.int64, len(encoded)))
        elif block.token_ids is not None:
            flat, lens = block.token_ids
            tokens.extend(np.split(flat, np.cumsum(lens)[:-1]) if len(lens) else [])
            lengths.append(np.minimum(lens, max_length).astype(np.int64))
    if not ids:
        raise InputError("no valid rows to sample", path=", ".join(config.input.paths))
    all_lengths = np.concatenate(lengths)
    keep = stratified_indices(all_lengths, n, seed)
    columns: dict[str, pa.Array] = {"id": id_array([ids[i] for i in keep])}
    if texts and config.input.pair_columns:  # the sample keeps the pairs in the run's two columns
        for side, name in enumerate(config.input.pair_columns):
            columns[name] = pa.array([texts[i][side] for i in keep], pa.string())
    elif texts:
        columns["text"] = pa.array([texts[i] for i in keep], pa.string())
    else:
        columns["input_ids"] = pa.array([tokens[i].tolist() for i in keep], pa.list_(pa.int64()))
    pq.write_table(pa.table(columns), out_path)
    return Sample(out_path, len(keep), len(ids), all_lengths[keep], all_lengths)
