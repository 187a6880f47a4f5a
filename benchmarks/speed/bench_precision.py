#!/usr/bin/env python
"""--precision: output bytes per row and rows/s of each precision against float32, in one run.

Each precision embeds the same corpus (--rows of sample_data/requests.jsonl, cycled) with the same
checkpoint (--model, the packaged all-MiniLM-L6-v2 by default: 384 dimensions) through
`hpcinfer.api.run` into Parquet, in one process after an untimed warm-up; rounds alternate the
precisions and the best round counts. For each precision it prints:

- Parquet bytes per row (the assembled output file) and its ratio to float32's;
- JSONL bytes per row, from the float32 run's vectors written by the same store into a .jsonl
  (no second embedding run), and the ratio;
- rows/s of the whole run and its ratio to float32's (the quantization is a few vector
  operations a window: it should not show);
- the store's own time for the rows (quantize + write one Parquet part + assemble);
- whether the output equals sentence-transformers' `quantize_embeddings` of the float32 output
  (int8/uint8 calibrated on the first window, which is every row here: --sort-window is larger).

    python benchmarks/speed/bench_precision.py [--rows 2000] [--rounds 1] [--threads 2] [--model default]

Seven runs of the model (a warm-up and one per precision) take about 3 1/2 minutes on 2 cores. The
store's own time is a few hundredths of a run's, so on a shared machine rows/s differences between
precisions are the machine's, not the precision's: read them with the store's time beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import lscpu  # noqa: E402

PRECISIONS = ("float32", "float16", "int8", "uint8", "binary", "ubinary")


def write_corpus(rows: int, path: Path) -> None:
    texts = [json.loads(x)["text"] for x in (ROOT / "sample_data" / "requests.jsonl").read_text().splitlines()]
    path.write_text("".join(json.dumps({"id": i, "text": texts[i % len(texts)]}) + "\n" for i in range(rows)))


def embed(corpus: Path, out: Path, model: str, threads: int, precision: str) -> float:
    """Seconds of one whole run (model load, read, embed, quantize, write, assemble)."""
    from hpcinfer.api import run
    from hpcinfer.config import DeviceConfig, EmbedConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
    from hpcinfer.obs.progress import Progress

    cfg = RunConfig(
        input=InputConfig((str(corpus),)),
        model=model,
        embed=EmbedConfig(precision=precision),
        device=DeviceConfig(device="cpu", threads=threads),
        output=OutputConfig(str(out), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
    )
    start = time.perf_counter()
    run(cfg, progress=Progress("off"))
    return time.perf_counter() - start


def embedding_array(path: Path) -> np.ndarray:
    column = pq.read_table(path).column("embedding").combine_chunks()
    return column.values.to_numpy(zero_copy_only=False).reshape(len(column), -1)


def store_only(vectors: np.ndarray, out: Path, fmt: str, precision: str) -> float:
    """Seconds to quantize and write `vectors` as one window and assemble them (no model)."""
    from hpcinfer.tasks.embed.precision import precision_store

    store = precision_store(str(out), fmt, vectors.shape[1], {}, precision, None)
    start = time.perf_counter()
    store.start_fresh()
    store.commit(0, 0, len(vectors), list(range(len(vectors))), vectors, [])
    store.assemble()
    return time.perf_counter() - start


def equals_sentence_transformers(path: Path, float32: np.ndarray, precision: str) -> bool:
    from sentence_transformers.util.quantization import quantize_embeddings

    ours = embedding_array(path)
    if precision == "float16":
        return bool(np.array_equal(ours, float32.astype(np.float16)))
    theirs = quantize_embeddings(float32, precision, calibration_embeddings=float32)
    return ours.dtype == theirs.dtype and bool(np.array_equal(ours, theirs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpu = lscpu().get("Model name", "unknown CPU")
    print(f"{args.rows} rows, {args.threads} threads, best of {args.rounds} round(s), {cpu}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        corpus = folder / "corpus.jsonl"
        write_corpus(args.rows, corpus)
        warm = folder / "warm.jsonl"
        write_corpus(200, warm)
        embed(warm, folder / "warm.parquet", args.model, args.threads, "float32")  # NOTE: untimed
        walls: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for _ in range(args.rounds):
            for precision in PRECISIONS:
                walls[precision].append(embed(corpus, folder / f"{precision}.parquet", args.model, args.threads,
                                              precision))  # fmt: skip
        float32 = embedding_array(folder / "float32.parquet")
        results = []
        for precision in PRECISIONS:
            parquet = folder / f"{precision}.parquet"
            jsonl = folder / f"{precision}-store.jsonl"
            store_s = store_only(float32, folder / f"{precision}-store.parquet", "parquet", precision)
            store_only(float32, jsonl, "jsonl", precision)
            best = min(walls[precision])
            results.append({
                "precision": precision,
                "parquet_bytes_per_row": round(parquet.stat().st_size / args.rows, 1),
                "jsonl_bytes_per_row": round(jsonl.stat().st_size / args.rows, 1),
                "rows_per_s": round(args.rows / best, 1),
                "store_ms": round(store_s * 1000, 1),
                "equals_quantize_embeddings": equals_sentence_transformers(parquet, float32, precision),
                "runs_s": [round(w, 2) for w in walls[precision]],
            })  # fmt: skip
    base = results[0]
    print(f"{'precision':<10}{'parquet B/row':>15}{'x f32':>8}{'jsonl B/row':>13}{'x f32':>8}"
          f"{'rows/s':>9}{'x f32':>7}{'store ms':>10}  equal")  # fmt: skip
    for r in results:
        print(f"{r['precision']:<10}{r['parquet_bytes_per_row']:>15.1f}"
              f"{base['parquet_bytes_per_row'] / r['parquet_bytes_per_row']:>8.2f}"
              f"{r['jsonl_bytes_per_row']:>13.1f}{base['jsonl_bytes_per_row'] / r['jsonl_bytes_per_row']:>8.2f}"
              f"{r['rows_per_s']:>9.1f}{r['rows_per_s'] / base['rows_per_s']:>7.2f}{r['store_ms']:>10.1f}"
              f"  {r['equals_quantize_embeddings']}")  # fmt: skip
    print(json.dumps({"cpu": cpu, "rows": args.rows, "threads": args.threads, "results": results}))
    if not all(r["equals_quantize_embeddings"] for r in results):
        raise SystemExit("an output differs from quantize_embeddings of the float32 output")


if __name__ == "__main__":
    main()
