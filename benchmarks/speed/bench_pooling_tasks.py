"""Pooling tasks, whole process against the tool people would use instead, side by side in one run.

- `embed-decoder`: a random Qwen2-shaped decoder embedder (hidden 384, 6 layers, 6 heads, 2 KV
  heads, intermediate 1024, the MiniLM vocabulary; sentence-transformers files: last-token
  pooling, normalised); `hpcinfer run --task embed` against sentence-transformers `encode`.
- `score`: a random cross-encoder of ms-marco-MiniLM-L-6-v2's shape (BERT, hidden 384, 6 layers,
  12 heads, one label); `hpcinfer run --task score` on (query, document) pairs against
  sentence-transformers `CrossEncoder.predict`.
- `classify`: a random BERT classifier of the same shape with 3 labels; `hpcinfer run --task
  classify` against transformers' `pipeline("text-classification")`.

Each side is a fresh `python` process timed from start to exit (imports, model load, reading the
corpus, writing the output), so start-up counts as users pay it. The other tool's best batch size
is picked first, in one process, by timing it at each of --batch-sizes on 512 rows (not counted).
Outputs are checked against each other (embeddings: minimum cosine; scores and probabilities:
largest absolute difference; labels: how many agree). Rounds alternate the two sides.

    python benchmarks/speed/bench_pooling_tasks.py [--tasks embed-decoder,score,classify] [--rows 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import timed_process  # noqa: E402

QWEN2_SHAPE = {"hidden": 384, "layers": 6, "heads": 6, "kv_heads": 2, "intermediate": 1024, "max_positions": 512}
MINILM_SHAPE = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}

# The other side's script: {setup} loads the model as `model`, {run} maps `rows` at batch size BATCH
# to `result`; with `pick`, it times each batch size on 512 rows and prints the best.
SCRIPT = """
import json, sys, time, torch
torch.set_num_threads({threads})
import numpy as np
rows = [json.loads(line) for line in open({corpus!r}, encoding="utf-8")]
{setup}
def go(rows, BATCH):
{run}
    return result
if {pick}:
    best = None
    for bs in {sizes}:
        t0 = time.perf_counter(); go(rows[:512], bs); s = time.perf_counter() - t0
        best = (s, bs) if best is None or s < best[0] else best
    print(best[1])
else:
    np.save({out!r}, np.asarray(go(rows, {batch})))
"""

TOKENIZER_FIX = """
# NOTE: the checkpoint's own tokenizer.json, as hpcinfer reads it (for a qwen2 model_type,
# AutoTokenizer would build its Qwen2 class over the MiniLM vocabulary, which splits it otherwise)
from transformers import PreTrainedTokenizerFast
model[0].processor = PreTrainedTokenizerFast(tokenizer_file={model!r} + "/tokenizer.json", pad_token="[PAD]",
                                             model_max_length=model.max_seq_length)
"""

OTHERS = {
    "embed-decoder": (
        "from sentence_transformers import SentenceTransformer\n"
        "model = SentenceTransformer({model!r}, device='cpu')\n" + TOKENIZER_FIX,
        "    result = model.encode([r['text'] for r in rows], batch_size=BATCH, show_progress_bar=False)",
    ),
    "score": (
        "from sentence_transformers import CrossEncoder\nmodel = CrossEncoder({model!r}, device='cpu')",
        "    result = model.predict([(r['query'], r['document']) for r in rows], batch_size=BATCH,"
        " show_progress_bar=False)",
    ),
    "classify": (
        "from transformers import pipeline\n"
        "model = pipeline('text-classification', model={model!r}, device='cpu', top_k=None, truncation=True)",
        "    out = model([r['text'] for r in rows], batch_size=BATCH)\n"
        "    labels = model.model.config.id2label\n"
        "    result = [[next(x['score'] for x in o if x['label'] == labels[i]) for i in range(len(labels))]"
        " for o in out]",
    ),
}


def build_model(task: str, folder: Path) -> Path:
    if task == "embed-decoder":
        from tests.fixtures.tiny_decoder import add_sentence_transformers_files, build_tiny_decoder

        path = build_tiny_decoder(folder / "qwen2-embedder", "Qwen2ForCausalLM", seed=0, **QWEN2_SHAPE)
        return add_sentence_transformers_files(path, "last", normalize=True, max_seq_length=256)
    from tests.fixtures.tiny_classifier import build_tiny_classifier

    labels = ("LABEL_0",) if task == "score" else ("negative", "neutral", "positive")
    return build_tiny_classifier(folder / task, "bert", labels, seed=0, **MINILM_SHAPE)


def write_corpus(task: str, rows: int, path: Path) -> None:
    texts = [json.loads(x)["text"] for x in (ROOT / "sample_data" / "requests.jsonl").read_text().splitlines()]
    out = []
    for i in range(rows):
        text = texts[i % len(texts)]
        if task == "score":  # a short query (the text's first words) against a document
            out.append({"id": i, "query": " ".join(texts[(i * 7) % len(texts)].split()[:8]), "document": text})
        else:
            out.append({"id": i, "text": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")


def compare(task: str, ours_path: Path, theirs: np.ndarray) -> dict:
    table = pq.read_table(ours_path)
    if task == "embed-decoder":
        ours = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
        return {"min_cosine": round(float((ours * theirs).sum(axis=1).min()), 6)}
    if task == "score":
        return {"max_abs_diff": float(np.abs(table.column("score").to_numpy() - theirs).max())}
    ours = np.asarray(table.column("scores").to_pylist(), dtype=np.float32)
    return {"max_abs_diff": float(np.abs(ours - theirs).max()),
            "same_label": int((ours.argmax(1) == theirs.argmax(1)).sum()), "rows": len(ours)}  # fmt: skip


def bench(task: str, args: argparse.Namespace, folder: Path, env: dict[str, str]) -> dict:
    model = build_model(task, folder)
    corpus = folder / f"{task}.jsonl"
    write_corpus(task, args.rows, corpus)
    setup, run = OTHERS[task]
    setup = setup.format(model=str(model))
    common = {"threads": args.threads, "corpus": str(corpus), "setup": setup, "run": run, "sizes": args.sizes}
    pick = SCRIPT.format(**common, pick=True, out="", batch=0)
    chosen = subprocess.run([sys.executable, "-c", pick], env=env, capture_output=True, text=True, check=False)
    if chosen.returncode != 0:
        raise SystemExit(chosen.stderr[-2000:])
    batch = int(chosen.stdout.strip().splitlines()[-1])
    theirs_out = folder / f"{task}.npy"
    theirs_cmd = [sys.executable, "-c", SCRIPT.format(**common, pick=False, out=str(theirs_out), batch=batch)]
    ours_out = folder / f"{task}.parquet"
    ours_cmd = [sys.executable, "-m", "hpcinfer", "run", str(corpus), "-o", str(ours_out), "--model", str(model),
                "--task", "embed" if task == "embed-decoder" else task, "--threads", str(args.threads),
                "--progress", "off", "-q", "--overwrite"]  # fmt: skip
    ours_cmd += ["--all-scores"] if task == "classify" else []
    times: dict[str, list[float]] = {"hpcinfer": [], "other": []}
    for _ in range(args.rounds):
        times["hpcinfer"].append(timed_process(ours_cmd, env)[0])
        times["other"].append(timed_process(theirs_cmd, env)[0])
    ours_s, theirs_s = statistics.median(times["hpcinfer"]), statistics.median(times["other"])
    return {"task": task, "other_batch_size": batch, "hpcinfer_s": round(ours_s, 2), "other_s": round(theirs_s, 2),
            "ratio": round(theirs_s / ours_s, 3), **compare(task, ours_out, np.load(theirs_out)),
            "runs": {k: [round(t, 2) for t in v] for k, v in times.items()}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="embed-decoder,score,classify")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="16,32,64,128")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.batch_sizes.split(",")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}
    others = {"embed-decoder": "sentence-transformers encode", "score": "CrossEncoder.predict",
              "classify": 'pipeline("text-classification")'}  # fmt: skip
    print(f"{args.rows} rows, {args.threads} threads, medians of {args.rounds} rounds, whole process")
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            result = bench(task, args, Path(tmp), env)
            print(json.dumps(result))
            print(f"{task}: hpcinfer {result['hpcinfer_s']:.2f} s, {others[task]} (batch {result['other_batch_size']})"
                  f" {result['other_s']:.2f} s: {result['ratio']:.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
