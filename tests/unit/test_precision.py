"""--precision against sentence-transformers' `quantize_embeddings` on the same job's float32 output.

Every precision's output equals `quantize_embeddings(float32 output, precision, ...)` exactly: int8
and uint8 calibrated on the first window's rows (or on --calibration's embeddings, ranges or an
earlier output's metadata), the same ranges for every window and for a resumed run; the refusals
are one line each.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sentence_transformers.util.quantization import quantize_embeddings

from hpcinfer.api import run
from hpcinfer.errors import ConfigError, StageError
from hpcinfer.files.parts import has_commits
from hpcinfer.obs.progress import Progress

from ..conftest import make_texts, run_job, small_config, write_jsonl

ROWS = 200
WINDOW = 60  # rows a window: four windows, so later windows use the first one's ranges
TEXTS = make_texts(ROWS, seed=11)


def embed(tmp_path, model, name: str, output: dict | None = None, **embed_options) -> pa.Table:
    tmp_path.mkdir(exist_ok=True)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])
    cfg = small_config(src, tmp_path / name, model, plan={"sort_window": WINDOW}, embed=embed_options,
                       output={"path": str(tmp_path / name), **(output or {})})  # fmt: skip
    return run_job(cfg)[1]


def values(table: pa.Table) -> np.ndarray:
    """The embedding column as the numpy array it holds (its own dtype)."""
    column = table.column("embedding").combine_chunks()
    return column.values.to_numpy(zero_copy_only=False).reshape(len(column), -1)


@pytest.fixture(scope="module")
def float32(tiny_model, tmp_path_factory) -> np.ndarray:
    folder = tmp_path_factory.mktemp("f32")
    return values(embed(folder, tiny_model, "out.parquet"))


@pytest.mark.parametrize("precision", ["float32", "float16", "int8", "uint8", "binary", "ubinary"])
def test_every_precision_equals_quantize_embeddings(tmp_path, tiny_model, float32, precision):
    table = embed(tmp_path, tiny_model, "out.parquet", precision=precision)
    ours = values(table)
    if precision == "float16":  # NOTE: not one of quantize_embeddings' precisions: the vectors as float16
        theirs = float32.astype(np.float16)
    else:
        theirs = quantize_embeddings(float32, precision, calibration_embeddings=float32[:WINDOW])
    assert ours.dtype == theirs.dtype
    assert ours.shape == theirs.shape == (ROWS, 4 if precision.endswith("binary") else float32.shape[1])
    assert np.array_equal(ours, theirs)
    assert table.column("id").to_pylist() == list(range(ROWS))
    meta = table.schema.metadata or {}
    if precision in ("int8", "uint8"):
        ranges = np.asarray(json.loads(meta[b"hpcinfer.quantization.ranges"]), dtype=np.float32)
        expected = np.vstack((float32[:WINDOW].min(axis=0), float32[:WINDOW].max(axis=0)))
        assert np.array_equal(ranges, expected)
    if precision != "float32":
        assert meta[b"hpcinfer.quantization.precision"] == precision.encode()


def test_float32_is_the_output_without_the_option(tmp_path, tiny_model, float32):
    table = embed(tmp_path, tiny_model, "out.parquet", precision="float32")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), float32.shape[1])
    assert not (table.schema.metadata or {}).get(b"hpcinfer.quantization.precision")


@pytest.mark.parametrize("precision", ["int8", "ubinary"])
def test_jsonl_holds_lists_of_ints(tmp_path, tiny_model, float32, precision):
    table = embed(tmp_path, tiny_model, "out.jsonl", precision=precision)
    rows = table.column("embedding").to_pylist()
    theirs = quantize_embeddings(float32, precision, calibration_embeddings=float32[:WINDOW])
    assert rows == theirs.tolist()
    assert all(isinstance(v, int) for v in rows[0])


def test_calibration_embeddings_ranges_and_an_earlier_output(tmp_path, tiny_model, float32):
    calibration = float32[50:150].astype(np.float64)  # NOTE: any float dtype: min/max first, then float32
    np.save(tmp_path / "calib.npy", calibration)
    ours = values(embed(tmp_path / "a", tiny_model, "out.parquet", precision="uint8",
                        calibration=str(tmp_path / "calib.npy")))  # fmt: skip
    assert np.array_equal(ours, quantize_embeddings(float32, "uint8", calibration_embeddings=calibration))

    ranges = np.vstack((float32.min(axis=0) * 0.5, float32.max(axis=0) * 0.5)).astype(np.float32)
    np.save(tmp_path / "ranges.npy", ranges)
    first = embed(tmp_path / "b", tiny_model, "out.parquet", precision="int8", calibration=str(tmp_path / "ranges.npy"))
    assert np.array_equal(values(first), quantize_embeddings(float32, "int8", ranges=ranges))

    # an earlier int8 output's metadata quantizes the same way
    again = embed(tmp_path / "c", tiny_model, "out.parquet", precision="int8",
                  calibration=str(tmp_path / "b" / "out.parquet"))  # fmt: skip
    assert again.equals(first)


def test_a_resumed_int8_run_writes_what_an_uninterrupted_one_does(tmp_path, tiny_model, one_torch_thread):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS)])

    def config(name: str, **output):  # noqa: ANN202
        return small_config(src, tmp_path / name, tiny_model, plan={"sort_window": WINDOW},
                            embed={"precision": "int8"}, output={"path": str(tmp_path / name), **output})  # fmt: skip

    report, whole = run_job(config("whole.parquet"))
    calls = {"n": 0}

    def fail_in_the_last_window(_item):
        calls["n"] += 1
        if calls["n"] == report.batches - 1:
            raise RuntimeError("injected fault")

    out = tmp_path / "part.parquet"
    with pytest.raises(StageError):
        run(config("part.parquet"), progress=Progress("off"), hooks={"write": fail_in_the_last_window})
    assert has_commits(str(out))  # NOTE: the first window (the ranges' own) is not computed again
    run_job(config("part.parquet", resume=True))
    assert pq.read_table(out).equals(whole)
    assert pq.read_schema(out).metadata == whole.schema.metadata


@pytest.mark.parametrize(
    ("task", "embed_options", "message"),
    [
        ("classify", {"precision": "int8"}, "--task classify does not read --precision"),
        ("embed", {"precision": "binary", "calibration": "x.npy"}, "--calibration sets int8/uint8 ranges"),
        ("embed", {"precision": "int4"}, "--precision must be one of"),
    ],
)
def test_refusals_are_one_line(tmp_path, tiny_model, task, embed_options, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "hi"}])
    cfg = small_config(src, tmp_path / "out.parquet", tiny_model, task=task, embed=embed_options)
    with pytest.raises(ConfigError, match=message) as caught:
        run(cfg, progress=Progress("off"))
    assert "\n" not in str(caught.value)


def test_an_openai_batch_input_is_refused(tmp_path, tiny_model):
    body = {"model": "m", "input": "hello"}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": body}
    src = write_jsonl(tmp_path / "req.jsonl", [line])
    cfg = small_config(src, tmp_path / "out.jsonl", tiny_model, embed={"precision": "int8"})
    with pytest.raises(ConfigError, match="OpenAI batch file is answered in OpenAI's float"):
        run(cfg, progress=Progress("off"))
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.jsonl.parts").exists()


def test_a_calibration_of_other_dimensions_is_refused(tmp_path, tiny_model):
    np.save(tmp_path / "calib.npy", np.zeros((4, 7), np.float32))
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "text": "hi"}])
    cfg = small_config(src, tmp_path / "out.parquet", tiny_model,
                       embed={"precision": "int8", "calibration": str(tmp_path / "calib.npy")})  # fmt: skip
    with pytest.raises(ConfigError, match="ranges for 7 dimensions"):
        run(cfg, progress=Progress("off"))
