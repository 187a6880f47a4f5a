"""Pooling tasks, whole process against the tool people would use instead, side by side in one run.

- `embed-decoder`: a random Qwen2-shaped decoder embedder (hidden 384, 6 layers, 6 heads, 2 KV
  heads, intermediate 1024, the MiniLM vocabulary; sentence-transformers files: last-token
  pooling, normalised) built once by the script; `hpcinfer run --task embed` against
  sentence-transformers `encode` at its best batch size.

Each side is a fresh `python` process timed from start to exit (imports, model load, reading the
corpus, writing the output), so start-up counts as users pay it. sentence-transformers' best batch
size is picked first, in one process, by timing `encode` at each of --st-batch-sizes (not counted).
The outputs are checked against each other (minimum cosine). Rounds alternate the two sides.

    python benchmarks/bench_pooling_tasks.py [--rows 2000] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

QWEN2_SHAPE = {"hidden": 384, "layers": 6, "heads": 6, "kv_heads": 2, "intermediate": 1024, "max_positions": 512}

ST_SCRIPT = """
import json, sys, time, torch
torch.set_num_threads({threads})
from sentence_transformers import SentenceTransformer
import numpy as np
texts = [json.loads(line)["text"] for line in open({corpus!r}, encoding="utf-8")]
model = SentenceTransformer({model!r}, device="cpu")
# NOTE: the checkpoint's own tokenizer.json, as hpcinfer reads it (for a qwen2 model_type,
# AutoTokenizer would build its Qwen2 class over the MiniLM vocabulary, which splits it otherwise)
from transformers import PreTrainedTokenizerFast
model[0].processor = PreTrainedTokenizerFast(tokenizer_file={model!r} + "/tokenizer.json", pad_token="[PAD]",
                                             model_max_length=model.max_seq_length)
{pick}
vectors = model.encode(texts, batch_size=BATCH, convert_to_numpy=True, show_progress_bar=False)
np.save({out!r}, vectors)
"""
PICK_BEST = """
best = None
for bs in {sizes}:
    t0 = time.perf_counter()
    model.encode(texts[:512], batch_size=bs, show_progress_bar=False)
    s = time.perf_counter() - t0
    print(bs, round(s, 3), file=sys.stderr)
    best = (s, bs) if best is None or s < best[0] else best
print(best[1])
raise SystemExit
"""


def build_decoder_embedder(folder: Path) -> Path:
    from hpcinfer.models.tiny_decoder import add_sentence_transformers_files, build_tiny_decoder

    path = build_tiny_decoder(folder / "qwen2-embedder", "Qwen2ForCausalLM", seed=0, **QWEN2_SHAPE)
    return add_sentence_transformers_files(path, "last", normalize=True, max_seq_length=256)


def wall(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--st-batch-sizes", default="16,32,64,128")
    args = ap.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = build_decoder_embedder(folder)
        corpus = folder / "corpus.jsonl"
        lines = (ROOT / "sample_data" / "requests.jsonl").read_text(encoding="utf-8").splitlines()
        corpus.write_text("\n".join((lines * (1 + args.rows // len(lines)))[: args.rows]) + "\n", encoding="utf-8")
        sizes = [int(s) for s in args.st_batch_sizes.split(",")]
        pick = PICK_BEST.format(sizes=sizes)
        script = ST_SCRIPT.format(threads=args.threads, corpus=str(corpus), model=str(model), pick=pick, out="")
        chosen = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        batch = int(chosen.stdout.strip().splitlines()[-1])
        st_out = folder / "st.npy"
        st_script = ST_SCRIPT.format(
            threads=args.threads, corpus=str(corpus), model=str(model), pick=f"BATCH = {batch}", out=str(st_out)
        )
        ours_out = folder / "ours.parquet"
        ours_cmd = [sys.executable, "-m", "hpcinfer", "run", str(corpus), "-o", str(ours_out), "--model",
                    str(model), "--task", "embed", "--threads", str(args.threads), "--progress", "off", "-q",
                    "--overwrite"]  # fmt: skip
        times: dict[str, list[float]] = {"hpcinfer": [], "st": []}
        for _ in range(args.rounds):
            times["hpcinfer"].append(wall(ours_cmd, env))
            times["st"].append(wall([sys.executable, "-c", st_script], env))
        ours = np.asarray(pq.read_table(ours_out).column("embedding").to_pylist(), dtype=np.float32)
        theirs = np.load(st_out)
        cosine = float((ours * theirs).sum(axis=1).min())
    ours_s, st_s = statistics.median(times["hpcinfer"]), statistics.median(times["st"])
    print(f"{args.rows} texts, {args.threads} threads, medians of {args.rounds} rounds, whole process")
    print(json.dumps({"task": "embed-decoder", "st_batch_size": batch, "hpcinfer_s": round(ours_s, 2),
                      "st_s": round(st_s, 2), "ratio": round(st_s / ours_s, 3), "min_cosine": round(cosine, 6),
                      "runs": {k: [round(t, 2) for t in v] for k, v in times.items()}}))  # fmt: skip
    print(f"embed-decoder: hpcinfer {ours_s:.2f} s, sentence-transformers (batch {batch}) {st_s:.2f} s: "
          f"{st_s / ours_s:.2f}x; min cosine {cosine:.6f}")  # fmt: skip


if __name__ == "__main__":
    main()
