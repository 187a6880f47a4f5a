"""--precision: embeddings written as float16, int8, uint8 or packed bits, equal to
sentence-transformers' `quantize_embeddings`.

int8/uint8 map each dimension's [min, max] onto 256 buckets; the ranges (a [2, dim] float32
array: mins, maxes) come from `--calibration` or else from the first window that has rows, and are
kept in the parts folder (`quantization-ranges.json`) before that window's part is written, so
every later window and a resumed run quantize the same way. The Parquet output carries them in its
schema metadata (`hpcinfer.quantization.ranges`), so a later run can take that file as its
`--calibration`. binary/ubinary pack `value > 0` 8 bits a byte (numpy.packbits), binary offset
by -128 as int8.

Parquet columns are fixed-size lists of the array's own type (halffloat, int8, uint8): a reader
gets back exactly the dtype `quantize_embeddings` returns, binary's signed bytes stay signed, and
on disk a list of int8 is as small as a fixed-size binary (no offsets, 1 byte a value).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...config import PRECISIONS
from ...errors import ConfigError, OutputError
from ...files.fingerprint import file_digest
from ...files.part_format import id_array, write_jsonl_rows, write_parquet
from ...files.parts import PartStore

CALIBRATED = ("int8", "uint8")  # the precisions that need per-dimension ranges
PRECISION_KEY = b"hpcinfer.quantization.precision"
RANGES_KEY = b"hpcinfer.quantization.ranges"
RANGES_FILE = "quantization-ranges.json"
_ARROW = {"float16": pa.float16(), "int8": pa.int8(), "uint8": pa.uint8(), "binary": pa.int8(), "ubinary": pa.uint8()}
_NUMPY = {"float16": np.float16, "int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


def quantized_dim(precision: str, dim: int) -> int:
    """Values a row has in `precision`: packed bits take a byte per 8 dimensions (the last one padded)."""
    return (dim + 7) // 8 if precision.endswith("binary") else dim


def ranges_of(embeddings: np.ndarray) -> np.ndarray:
    """[2, dim]: each dimension's min and max over `embeddings`, as quantize_embeddings calibrates."""
    return np.vstack((np.min(embeddings, axis=0), np.max(embeddings, axis=0))).astype(np.float32)


def quantize(values: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """[rows, dim] float32 -> `precision`, step for step as quantize_embeddings (same dtypes, same
    float32 arithmetic), so the bytes are equal."""
    if precision == "float32":
        return values.astype(np.float32)
    if precision == "float16":
        return values.astype(np.float16)
    if precision in CALIBRATED:
        assert ranges is not None, "int8/uint8 need ranges"
        ranges = ranges.astype(np.float32, copy=False)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)  # NOTE: a constant dimension: every value in bucket 0
        buckets = np.clip(np.floor((values - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    if precision == "binary":
        return (np.packbits(values > 0, axis=-1) - 128).astype(np.int8)
    if precision == "ubinary":
        return np.packbits(values > 0, axis=-1)
    raise ValueError(f"precision {precision!r} is not supported")


def calibration_ranges(path: str, dim: int) -> np.ndarray:
    """--calibration FILE as [2, dim] ranges.

    A .npy is calibration embeddings [n, dim] (n >= 2); a [2, dim] ranges array (mins row, maxes
    row) is one too, since its per-dimension min and max are its own rows. A .parquet is an output
    written with --precision int8/uint8: the ranges in its schema metadata.
    """
    if path.endswith(".parquet"):
        try:
            meta = pq.read_schema(path).metadata or {}
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"--calibration {path}: cannot read it ({exc})") from exc
        if RANGES_KEY not in meta:
            raise ConfigError(f"--calibration {path}: no {RANGES_KEY.decode()} in its metadata (an int8/uint8 output)")
        ranges = np.asarray(json.loads(meta[RANGES_KEY]), dtype=np.float32)
    else:
        try:
            embeddings = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--calibration {path}: not a readable .npy ({exc})") from exc
        if embeddings.ndim != 2 or embeddings.shape[0] < 2 or not np.issubdtype(embeddings.dtype, np.floating):
            raise ConfigError(
                f"--calibration {path}: needs float embeddings [n >= 2, dim] or ranges [2, dim] "
                f"(got {embeddings.dtype} {list(embeddings.shape)})"
            )
        # NOTE: min/max in the file's own dtype, then float32, as quantize_embeddings does
        ranges = np.vstack((np.min(embeddings, axis=0), np.max(embeddings, axis=0))).astype(np.float32)
    if ranges.shape != (2, dim):
        raise ConfigError(f"--calibration {path}: ranges for {ranges.shape[-1]} dimensions; the embeddings have {dim}")
    return ranges


class QuantizedStore(PartStore):
    """A PartStore whose parts hold the window's vectors in `precision` (never float32: that is PartStore's)."""

    def __init__(
        self, output: str, fmt: str, dim: int, fp: dict[str, Any], precision: str, ranges: np.ndarray | None = None
    ) -> None:
        super().__init__(output, fmt, dim, fp)
        self.precision = precision
        self.given_ranges = ranges  # from --calibration
        self.ranges = ranges

    def start_fresh(self) -> None:
        super().start_fresh()
        self.ranges = self.given_ranges
        if self.ranges is not None:
            self._save_ranges()

    def load(self) -> None:
        """The interrupted run's windows and, before anything is written, the ranges they were quantized with."""
        super().load()
        if self.precision not in CALIBRATED:
            return
        saved = self.folder.read_bytes(self.aux + RANGES_FILE)
        if saved is not None:
            self.ranges = np.asarray(json.loads(saved), dtype=np.float32)
        elif self.given_ranges is None and self.rows_written:
            raise OutputError(
                f"cannot resume: {RANGES_FILE} is missing from the parts; rerun with --overwrite to start over",
                path=self.output,
            )

    def _save_ranges(self) -> None:
        text = json.dumps(self.ranges.tolist())  # NOTE: float32 -> float64 -> JSON and back is exact
        self.folder.write(self.aux + RANGES_FILE, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def commit(
        self,
        window_id: int,
        first_row: int,
        input_rows: int,
        ids: list[Any],
        values: np.ndarray,
        rejects: list[dict[str, Any]],
        meta: dict[str, list[Any]] | None = None,
    ) -> None:
        if self.precision in CALIBRATED and self.ranges is None and len(values):
            if len(values) == 1:  # NOTE: quantize_embeddings refuses this too: every dimension one bucket
                raise ConfigError(
                    f"--precision {self.precision}: the first window has one embedding to calibrate on; "
                    "give --calibration FILE"
                )
            # NOTE: saved before the window's part and manifest, so a resume always finds them
            self.ranges = ranges_of(values)
            self._save_ranges()
        super().commit(window_id, first_row, input_rows, ids, values, rejects, meta)

    def _write_part(
        self, tmp: Path, ids: list[Any], values: np.ndarray, meta: dict[str, list[Any]] | None, rejects: list[Any]
    ) -> None:
        quantized = self._quantized(values)
        if self.fmt == "parquet":
            write_parquet(self._table(ids, quantized), tmp)
        else:
            rows = ({"id": i, "embedding": v} for i, v in zip(ids, quantized.tolist(), strict=True))
            write_jsonl_rows(tmp, rows)

    def _quantized(self, values: np.ndarray) -> np.ndarray:
        if not len(values):  # NOTE: a window of rejects only; nothing to calibrate on yet
            return np.zeros((0, quantized_dim(self.precision, self.dim)), _NUMPY[self.precision])
        return quantize(values, self.precision, self.ranges)

    def _table(self, ids: list[Any], quantized: np.ndarray) -> pa.Table:
        flat = pa.array(quantized.reshape(-1), type=_ARROW[self.precision])
        width = quantized_dim(self.precision, self.dim)
        table = pa.table({"id": id_array(ids), "embedding": pa.FixedSizeListArray.from_arrays(flat, width)})
        return table.replace_schema_metadata(self._metadata())

    def _metadata(self) -> dict[bytes, bytes]:
        meta = {PRECISION_KEY: self.precision.encode()}
        if self.ranges is not None and self.precision in CALIBRATED:
            meta[RANGES_KEY] = json.dumps(self.ranges.tolist()).encode()
        return meta

    def empty_schema(self) -> pa.Schema:
        """The output's schema, with the precision and (int8/uint8) the ranges every part was quantized with."""
        return self._table([], self._quantized(np.zeros((0, self.dim), np.float32))).schema


def calibration_digest(path: str | None) -> str | None:
    """What the resume fingerprint keeps of --calibration: its contents (a changed file is refused)."""
    if path is None:
        return None
    if not Path(path).is_file():
        raise ConfigError(f"--calibration {path}: no such file")
    return file_digest(path)


def precision_store(
    output: str, fmt: str, dim: int, fp: dict[str, Any], precision: str, calibration: str | None
) -> PartStore:
    """The store for --precision: PartStore itself for float32 (the bytes of a run without it)."""
    if precision == "float32":
        return PartStore(output, fmt, dim, fp)
    ranges = calibration_ranges(calibration, dim) if calibration is not None else None
    return QuantizedStore(output, fmt, dim, fp, precision, ranges)


__all__ = [
    "CALIBRATED",
    "PRECISIONS",
    "QuantizedStore",
    "calibration_digest",
    "calibration_ranges",
    "precision_store",
    "quantize",
    "quantized_dim",
    "ranges_of",
]
