"""The tuning sample of an embedding run: rows drawn by token length (`tune.sample.stratified_indices`)
from the input's first rows, written to a Parquet file the trials read."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..config import RunConfig
from ..errors import InputError
from ..files.part_format import id_array
from ..models.registry import load_tokenizer
from ..tune.sample import Sample, stratified_indices
from .options import embed_checkpoint
from .read import Reader


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
