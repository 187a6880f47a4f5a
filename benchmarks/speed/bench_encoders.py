"""The native encoders against what a user would run instead, whole process, side by side in one run.

For each architecture (`--architectures`), a random checkpoint at real size (hidden 768, 12
layers, 12 heads, intermediate 3072, the MiniLM vocabulary; mean pooling; max_seq_length 512),
built by the installed transformers and saved by sentence-transformers, embeds the corpus
(sample_data's texts, mixed lengths) three ways:

- `hpcinfer run` with no backend flag (native for these architectures);
- `hpcinfer run --backend transformers` (transformers' own model in hpcinfer's pipeline);
- sentence-transformers `encode` at its best batch size (picked first on 128 rows per size, not
  counted);
- with `--bfloat16`, also `hpcinfer run --dtype bfloat16` and sentence-transformers with the model
  in bfloat16 (its own best batch size), both sides' arithmetic on a CPU's AMX or AVX-512 BF16 units.

Each is a fresh process timed from start to exit, so start-up counts as users pay it. Outputs are
checked against each other (minimum cosine). Then, for ModernBERT, an in-process comparison of
its batches packed without padding against the same loaded weights run padded, and the default
(packed only where a batch is mostly padding): the whole run on length-sorted batches, and the
model alone on batches of rows in arrival order.

    python benchmarks/speed/bench_encoders.py [--architectures mpnet,xlm-roberta,modernbert] [--rows 1000]
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import cpu_line, timed_process  # noqa: E402
from benchmarks.speed.bench_pooling_tasks import SCRIPT, write_corpus  # noqa: E402

BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
ARCHITECTURES = {  # name -> (transformers' class prefix, config fields)
    "mpnet": ("MPNet", {**BASE, "max_position_embeddings": 514, "pad_token_id": 1}),
    "xlm-roberta": ("XLMRoberta", {**BASE, "max_position_embeddings": 514, "pad_token_id": 1, "type_vocab_size": 1}),
    # ModernBERT-base's shape: 22 layers, intermediate 1152, local window 128
    "modernbert": ("ModernBert", {"hidden_size": 768, "num_hidden_layers": 22, "num_attention_heads": 12,
                                  "intermediate_size": 1152, "max_position_embeddings": 8192, "pad_token_id": 0,
                                  "bos_token_id": 101, "eos_token_id": 102, "cls_token_id": 101,
                                  "sep_token_id": 102}),
    "distilbert": ("DistilBert", {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072}),
    "nomic_bert": ("NomicBert", {**BASE, "max_position_embeddings": 2048}),
}  # fmt: skip
ST_SETUP = "from sentence_transformers import SentenceTransformer\nmodel = SentenceTransformer({model!r}, device='cpu')"
ST_SETUP_BF16 = ST_SETUP[:-1] + ", model_kwargs={{'dtype': torch.bfloat16}})"
ST_RUN_BF16 = (
    "    result = model.encode([r['text'] for r in rows], batch_size=BATCH, show_progress_bar=False,"
    " convert_to_tensor=True).float().numpy()"
)
ST_RUN = "    result = model.encode([r['text'] for r in rows], batch_size=BATCH, show_progress_bar=False)"
PICK_ROWS = 128


def build(folder: Path, name: str) -> Path:
    """A random `name` model at real size, as a saved SentenceTransformer (mean pooling, 512 tokens)."""
    from tests.fixtures.tiny_encoders import build_tiny_encoder

    return build_tiny_encoder(folder, name, fields=ARCHITECTURES[name][1], limit=512, wide=False)


def embeddings(path: Path) -> np.ndarray:
    return np.asarray(pq.read_table(path).column("embedding").to_pylist(), dtype=np.float32)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return round(float(cos.min()), 6)


def bench(name: str, args: argparse.Namespace, folder: Path, env: dict[str, str]) -> dict:
    model = build(folder, name)
    corpus = folder / "corpus.jsonl"
    write_corpus("embed", args.rows, corpus)
    pick_corpus = folder / "pick.jsonl"
    write_corpus("embed", PICK_ROWS, pick_corpus)
    sides = {}
    batches = {}
    setups = {"sentence-transformers": (ST_SETUP, ST_RUN)}
    if args.bfloat16:
        setups["sentence-transformers bfloat16"] = (ST_SETUP_BF16, ST_RUN_BF16)
    for side, (setup, run) in setups.items():
        common = {"threads": args.threads, "setup": setup.format(model=str(model)), "run": run, "sizes": args.sizes}
        pick = SCRIPT.format(**common, corpus=str(pick_corpus), pick=True, out="", batch=0)
        chosen = subprocess.run([sys.executable, "-c", pick.replace("rows[:512]", "rows")], env=env,
                                capture_output=True, text=True, check=False)  # fmt: skip
        if chosen.returncode != 0:
            raise SystemExit(chosen.stderr[-2000:])
        batches[side] = int(chosen.stdout.strip().splitlines()[-1])
        out = folder / f"{name}-{side.replace(' ', '-')}.npy"
        encode = SCRIPT.format(**common, corpus=str(corpus), pick=False, out=str(out), batch=batches[side])
        sides[side] = [sys.executable, "-c", encode]
    batch = batches["sentence-transformers"]
    st_out = folder / f"{name}-sentence-transformers.npy"
    extras = {"hpcinfer": [], "hpcinfer --backend transformers": ["--backend", "transformers"]}
    if args.bfloat16:
        extras["hpcinfer --dtype bfloat16"] = ["--dtype", "bfloat16"]
    for side, extra in extras.items():
        out = folder / f"{name}-{'-'.join(extra) or 'native'}.parquet"
        sides[side] = [sys.executable, "-m", "hpcinfer", "run", str(corpus), "-o", str(out), "--model", str(model),
                       "--threads", str(args.threads), "--progress", "off", "-q", "--overwrite", *extra]  # fmt: skip
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, cmd in sides.items():
            times[side].append(timed_process(cmd, env)[0])
    s = {side: statistics.median(t) for side, t in times.items()}
    theirs = np.load(st_out)
    native = embeddings(folder / f"{name}-native.parquet")
    fallback = embeddings(folder / f"{name}---backend-transformers.parquet")
    bf16 = {}
    if args.bfloat16:
        half = embeddings(folder / f"{name}---dtype-bfloat16.parquet")
        ratio = s["sentence-transformers"] / s["hpcinfer --dtype bfloat16"]
        both = s["sentence-transformers bfloat16"] / s["hpcinfer --dtype bfloat16"]
        theirs_half = np.load(folder / f"{name}-sentence-transformers-bfloat16.npy")
        bf16 = {"bfloat16_vs_sentence_transformers": round(ratio, 3),
                "bfloat16_vs_sentence_transformers_bfloat16": round(both, 3),
                "st_bfloat16_batch_size": batches["sentence-transformers bfloat16"],
                "min_cosine_bfloat16_st": min_cosine(half, theirs),
                "min_cosine_st_bfloat16_st": min_cosine(theirs_half, theirs)}  # fmt: skip
    return {
        "architecture": name, "st_batch_size": batch, **{f"{k}_s": round(v, 2) for k, v in s.items()},
        "vs_sentence_transformers": round(s["sentence-transformers"] / s["hpcinfer"], 3),
        "vs_backend_transformers": round(s["hpcinfer --backend transformers"] / s["hpcinfer"], 3),
        "min_cosine_native_st": min_cosine(native, theirs), "min_cosine_fallback_st": min_cosine(fallback, theirs),
        **bf16,
    }  # fmt: skip


def unpadded_against_padded(args: argparse.Namespace, folder: Path) -> list[dict]:
    """ModernBERT's batches packed without padding against the same loaded weights run padded, in
    one process, alternating, two ways: the whole run on the pipeline's length-sorted batches (the
    default --sort-window), and the model alone on batches of 16 rows taken in arrival order,
    padded to their longest (what a batch holds where nothing sorts it: sentence-transformers'
    callers' own batches, a stream of requests)."""
    import torch

    from hpcinfer.api import run
    from hpcinfer.config import InputConfig, OutputConfig, PipelineConfig, PlanConfig, RunConfig
    from hpcinfer.models.modernbert import UNPAD_BELOW
    from hpcinfer.models.registry import inspect_embedder, load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    model = folder / "modernbert"
    corpus = folder / "corpus.jsonl"
    loaded = load_model(inspect_embedder(model, "embed"), torch.device("cpu"), torch.float32)
    encoder = loaded.embedder.encoder
    modes = {"padded": 0.0, "packed": 2.0, "default": UNPAD_BELOW}
    results = []
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, below in modes.items():
            encoder.unpad_below = below
            out = OutputConfig(str(folder / f"mb-{mode}.parquet"), overwrite=True)
            cfg = RunConfig(input=InputConfig((str(corpus),)), model=str(model), output=out,
                            plan=PlanConfig(), pipeline=PipelineConfig(progress="off"))  # fmt: skip
            start = time.perf_counter()
            report = run(cfg, model=loaded)
            times[mode].append(time.perf_counter() - start)
    cos = min_cosine(embeddings(folder / "mb-packed.parquet"), embeddings(folder / "mb-padded.parquet"))
    results.append(summary("length-sorted batches, whole run", report.padding_efficiency, times, cos))

    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    rows = [e.ids for e in load_tokenizer(model, 512).encode_batch(texts[:256])]
    batches = []
    for i in range(0, len(rows), 16):
        chunk = rows[i : i + 16]
        ids = torch.zeros(len(chunk), max(map(len, chunk)), dtype=torch.long)
        for j, row in enumerate(chunk):
            ids[j, : len(row)] = torch.tensor(row)
        batches.append((ids, torch.tensor([len(r) for r in chunk])))
    efficiency = sum(map(len, rows)) / sum(ids.numel() for ids, _ in batches)
    times = {mode: [] for mode in modes}
    outputs: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.rounds):
        for mode, below in modes.items():
            encoder.unpad_below = below
            start = time.perf_counter()
            outputs[mode] = [loaded.embedder(ids, lengths) for ids, lengths in batches]
            times[mode].append(time.perf_counter() - start)
    cos = min(float(torch.nn.functional.cosine_similarity(a, b).min()) for a, b in zip(outputs["packed"],
              outputs["padded"], strict=True))  # fmt: skip
    results.append(summary("batches of 16 in arrival order, the model alone", efficiency, times, round(cos, 6)))
    return results


def summary(name: str, efficiency: float, times: dict[str, list[float]], cos: float) -> dict:
    s = {mode: statistics.median(t) for mode, t in times.items()}
    return {"batches": name, "padding_efficiency": round(efficiency, 3),
            **{f"{m}_s": round(v, 2) for m, v in s.items()}, "packed_vs_padded": round(s["padded"] / s["packed"], 3),
            "default_vs_padded": round(s["padded"] / s["default"], 3), "min_cosine_packed_padded": cos}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--architectures", default="mpnet,xlm-roberta,modernbert")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="16,32,64")
    ap.add_argument("--bfloat16", action="store_true", help="also time hpcinfer --dtype bfloat16 (AMX / AVX-512 BF16)")
    ap.add_argument("--no-packing", action="store_true", help="skip ModernBERT's packed-against-padded comparison")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.batch_sizes.split(",")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}
    print(cpu_line(args.threads))
    print(f"{args.rows} rows, {args.threads} threads, medians of {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.architectures.split(","):
            result = bench(name, args, Path(tmp), env)
            print(json.dumps(result), flush=True)
            print(f"{name}: hpcinfer {result['hpcinfer_s']:.1f} s; {result['vs_sentence_transformers']:.2f}x "
                  f"sentence-transformers (batch {result['st_batch_size']}), "
                  f"{result['vs_backend_transformers']:.2f}x --backend transformers", flush=True)  # fmt: skip
            if args.bfloat16:
                print(f"{name}, bfloat16 on both sides: hpcinfer {result['hpcinfer --dtype bfloat16_s']:.1f} s, "
                      f"sentence-transformers {result['sentence-transformers bfloat16_s']:.1f} s (batch "
                      f"{result['st_bfloat16_batch_size']}): "
                      f"{result['bfloat16_vs_sentence_transformers_bfloat16']:.2f}x", flush=True)  # fmt: skip
            if name == "modernbert" and not args.no_packing:
                for packed in unpadded_against_padded(args, Path(tmp)):
                    print(json.dumps(packed))
                    print(f"modernbert, {packed['batches']} (padding efficiency "
                          f"{packed['padding_efficiency']:.2f}): packed {packed['packed_vs_padded']:.2f}x padded, "
                          f"the default {packed['default_vs_padded']:.2f}x padded", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
