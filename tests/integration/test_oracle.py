"""The default model on sample_data against sentence-transformers, the oracle.

hpcinfer embeds the sample's first 300 rows with every default (they hold rows of every padded
length: each multiple of 8 tokens up to the model's 256, and 15 rows past it, which truncate);
the oracle encodes a slice holding rows of each of those lengths, so every length bucket the
planner can cut is compared, without encoding every row twice.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from sentence_transformers import SentenceTransformer  # the oracle: in the test extra, never skipped

from hpcinfer.config import InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.models.registry import resolve_model_path

from ..conftest import SAMPLE_PARQUET, run_job

ROWS = 300


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The sample's first ROWS rows, as a Parquet file of the sample's own columns."""
    path = tmp_path_factory.mktemp("oracle-input") / "sample.parquet"
    pq.write_table(pq.read_table(SAMPLE_PARQUET).slice(0, ROWS), path)
    return path


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, sample):
    out = tmp_path_factory.mktemp("oracle") / "out.parquet"
    cfg = RunConfig(
        input=InputConfig((str(sample),)),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
    )
    return run_job(cfg)


def length_bucket_slice(lengths: list[int], max_length: int, per_bucket: int = 2) -> list[int]:
    """Row indices: the first `per_bucket` rows of each padded length (a multiple of 8 tokens,
    rows past `max_length` in a bucket of their own), in input order."""
    taken: dict[int, int] = {}
    chosen = []
    for i, n in enumerate(lengths):
        bucket = (min(n, max_length + 1) + 7) // 8
        if taken.get(bucket, 0) < per_bucket:
            taken[bucket] = taken.get(bucket, 0) + 1
            chosen.append(i)
    return chosen


def test_embeddings_equal_sentence_transformers(default_run, sample):
    _, table = default_run
    texts = pq.read_table(sample, columns=["text"]).column("text").to_pylist()
    oracle = SentenceTransformer(str(resolve_model_path("default")), device="cpu")
    lengths = [len(ids) for ids in oracle.tokenizer(texts)["input_ids"]]
    rows = length_bucket_slice(lengths, oracle.max_seq_length)
    assert len({(min(lengths[i], 257) + 7) // 8 for i in rows}) >= 30  # short rows, long rows, truncated rows
    expected = oracle.encode([texts[i] for i in rows], batch_size=64, convert_to_numpy=True, normalize_embeddings=False)
    all_ours = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    ours = all_ours[rows]
    cos = (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))
    assert len(all_ours) == len(texts)
    assert cos.min() >= 0.9999, f"min cosine {cos.min():.6f} at row {rows[int(cos.argmin())]}"


def test_rows_ids_and_order_match_the_input(default_run, sample):
    report, table = default_run
    ids = pq.read_table(sample, columns=["id"]).column("id").to_pylist()
    assert table.column("id").to_pylist() == ids
    assert report.rows == len(ids)


def test_padding_efficiency_with_defaults(default_run):
    report, _ = default_run
    assert report.padding_efficiency >= 0.95
    assert report.truncated_rows > 0  # the sample holds rows past 256 tokens
