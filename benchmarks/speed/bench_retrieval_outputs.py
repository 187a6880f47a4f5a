#!/usr/bin/env python
"""The retrieval output kinds against dense float32 embeddings: rows/s and Parquet bytes per row, in one run.

Every kind reads the same corpus (--rows of sample_data/requests.jsonl, cycled) through
`hpcinfer.api.run` in this process, into Parquet, on a MiniLM-shaped BERT (hidden 384, 6 layers,
12 heads, intermediate 1536, the packaged MiniLM tokenizer; random weights: the timing does not
depend on them):

1. dense float32      --task embed                          (the baseline)
2. int8, binary       --task embed --precision int8|binary  (quantized outputs)
3. token_embeddings   --task embed --output-value token_embeddings (one vector per token)
4. sparse             --task sparse on a SPLADE checkpoint of the same encoder with BERT's masked-LM
                      head (vocabulary x hidden per token), built by sentence-transformers as
                      tests/unit/test_sparse.py builds its tiny one. Its decoder bias is set from a
                      sample so a row keeps about --sparse-active of the 30522 entries, as trained
                      SPLADE models do (random weights would keep half the vocabulary).

rows/s is the run's own wall time (report.wall_s: read, tokenize, forward, write, assemble), so the
model load is out of every figure alike; "whole s" beside it counts the load too. Rounds alternate
the kinds after an untimed warm-up of each; the best round counts. For sparse it also times, with
torch on one batch of the corpus, the encoder alone against the encoder + MLM head, and prints the
head's share of the forward, which bounds sparse against dense (the same encoder, plus the head),
and times sentence-transformers' `SparseEncoder.encode` on the same texts. A kind below --target
(0.9) of dense says where its time goes.

    python benchmarks/speed/bench_retrieval_outputs.py [--rows 2000] [--rounds 1] [--threads 2]

On 2 cores, 2,000 rows: about 3 1/2 minutes. On a shared machine a few percent between the dense kinds is
the machine's: use --rounds 3 to read those.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.common import lscpu  # noqa: E402

MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's
# kind -> (task, EmbedConfig fields)
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense float32": ("embed", {}),
    "int8": ("embed", {"precision": "int8"}),
    "binary": ("embed", {"precision": "binary"}),
    "token_embeddings": ("embed", {"output_value": "token_embeddings"}),
    "sparse (SPLADE)": ("sparse", {}),
}


def corpus_texts(rows: int) -> list[str]:
    texts = [json.loads(x)["text"] for x in (ROOT / "sample_data" / "requests.jsonl").read_text().splitlines()]
    return [texts[i % len(texts)] for i in range(rows)]


def write_corpus(texts: list[str], path: Path) -> None:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))


def build_dense(folder: Path) -> Path:
    from hpcinfer.models.registry import resolve_model_path
    from tests.fixtures.tiny import build_minilm_shaped

    return build_minilm_shaped(folder / "dense", resolve_model_path("default"))


def build_splade(folder: Path, sample: list[str], active: int) -> Path:
    """A random MiniLM-shaped SPLADE SparseEncoder (BertForMaskedLM + SpladePooling max/relu) saved by
    sentence-transformers. The MLM decoder's bias is set so that, on `sample`, a row's max-pooled
    logits keep about `active` entries above zero (without it relu keeps half the vocabulary, and
    the output, not the model, would be timed)."""
    import torch
    import transformers
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    from hpcinfer.models.registry import resolve_model_path

    tokenizer_from = resolve_model_path("default")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=1536, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.zero_()
        batch = tokenizer(sample, padding=True, truncation=True, max_length=MAX_SEQ_LENGTH, return_tensors="pt")
        logits = model(**batch).logits.masked_fill(~batch["attention_mask"].bool()[..., None], float("-inf"))
        pooled = logits.amax(dim=1)  # [rows, vocab]: SPLADE's max pooling before relu
        # the bias that leaves `active` entries per row above zero, on average over the sample
        threshold = pooled.topk(active, dim=1).values[:, -1].mean()
        model.cls.predictions.bias.fill_(-float(threshold))
    raw = folder / "splade-mlm"
    model.save_pretrained(raw, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, raw / name)
    mlm = MLMTransformer(str(raw), max_seq_length=MAX_SEQ_LENGTH)
    encoder = SparseEncoder(modules=[mlm, SpladePooling(pooling_strategy="max", activation_function="relu")],
                            device="cpu")  # fmt: skip
    path = folder / "splade"
    encoder.save(str(path))
    return path


def head_share(raw: Path, texts: list[str], threads: int) -> dict[str, float]:
    """Seconds of one batch's forward through the encoder alone and through encoder + MLM head
    (transformers, float32, best of 3), and the head's share of the latter."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    tokenizer = transformers.AutoTokenizer.from_pretrained(raw)
    model = transformers.BertForMaskedLM.from_pretrained(raw).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=MAX_SEQ_LENGTH, return_tensors="pt")

    def best(fn: Any) -> float:
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - start)
        return min(walls)

    with torch.inference_mode():
        model(**batch)  # NOTE: warm-up
        encoder_s = best(lambda: model.bert(**batch))
        full_s = best(lambda: model(**batch))
    return {"encoder_s": encoder_s, "full_s": full_s, "head_share": max(0.0, 1 - encoder_s / full_s),
            "tokens": int(batch["attention_mask"].sum()), "rows": len(texts)}  # fmt: skip


HIDDEN, LAYERS, INTERMEDIATE, VOCAB = 384, 6, 1536, 30522  # the MiniLM shape both models have


def encoder_flops(tokens: float) -> float:
    """FLOPs per token of the encoder: per layer QKV and output projections, the MLP, and attention
    over a row of `tokens` (scores and the weighted sum)."""
    h = HIDDEN
    return LAYERS * 2 * (4 * h * h + 2 * h * INTERMEDIATE + 2 * tokens * h)


def head_flops() -> float:
    """FLOPs per token of BERT's masked-LM head: the hidden x hidden transform, then hidden x vocabulary."""
    return 2 * (HIDDEN * HIDDEN + HIDDEN * VOCAB)


def sentence_transformers_sparse(path: Path, texts: list[str], threads: int) -> float:
    """Seconds for `SparseEncoder.encode` of the same texts (its default batch of 32, after a warm-up):
    what a user of sentence-transformers runs for the same vectors."""
    import torch
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(threads)
    model = SparseEncoder(str(path), device="cpu")
    model.encode(texts[:64], batch_size=32)
    start = time.perf_counter()
    model.encode(texts, batch_size=32)
    return time.perf_counter() - start


def run_kind(corpus: Path, out: Path, model: Path, threads: int, task: str, embed: dict[str, Any]) -> tuple[Any, float]:
    """(hpcinfer's report, seconds of the whole call, model load included)."""
    from hpcinfer.api import run
    from hpcinfer.config import DeviceConfig, EmbedConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
    from hpcinfer.obs.progress import Progress

    cfg = RunConfig(
        input=InputConfig((str(corpus),)),
        model=str(model),
        task=task,
        embed=EmbedConfig(**embed),
        device=DeviceConfig(device="cpu", threads=threads),
        output=OutputConfig(str(out), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
    )
    start = time.perf_counter()
    report = run(cfg, progress=Progress("off"))
    return report, time.perf_counter() - start


def where_time_goes(kind: str, result: dict[str, Any], base: dict[str, Any], head: dict[str, float] | None) -> str:
    """One line on why a kind is slower than dense float32."""
    if kind.startswith("sparse") and head is not None:
        return (f"the MLM head (vocab x hidden = 30522 x 384 per token, plus a 384x384 transform) is "
                f"{head['head_share']:.0%} of the forward on one batch; hpcinfer's bottleneck: "
                f"{result['bottleneck'] or 'none named'}")  # fmt: skip
    if result["bytes_per_row"] > 4 * base["bytes_per_row"]:
        return (f"output: {result['bytes_per_row'] / base['bytes_per_row']:.0f}x the bytes per row to write; "
                f"hpcinfer's bottleneck: {result['bottleneck'] or 'none named'}")  # fmt: skip
    return f"hpcinfer's bottleneck: {result['bottleneck'] or 'none named'}; stages: {result['stages']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparse-active", type=int, default=200, help="entries a sparse row keeps, about")
    ap.add_argument("--head-batch", type=int, default=32, help="rows of the batch the MLM head's share is timed on")
    ap.add_argument("--target", type=float, default=0.9, help="the ratio to dense float32 a kind should reach")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpu = lscpu().get("Model name", "unknown CPU")
    print(f"{args.rows} rows, {args.threads} threads, best of {args.rounds} round(s), hpcinfer.api.run in-process, "
          f"{cpu}", flush=True)  # fmt: skip
    texts = corpus_texts(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        corpus, warm = folder / "corpus.jsonl", folder / "warm.jsonl"
        write_corpus(texts, corpus)
        write_corpus(texts[:100], warm)
        dense = build_dense(folder)
        splade = build_splade(folder, texts[:64], args.sparse_active)
        models = {kind: (splade if task == "sparse" else dense) for kind, (task, _) in KINDS.items()}
        for kind, (task, embed) in KINDS.items():  # NOTE: untimed, each kind's code paths warmed
            run_kind(warm, folder / "warm.parquet", models[kind], args.threads, task, embed)
        reports: dict[str, list[tuple[Any, float]]] = {k: [] for k in KINDS}
        for _ in range(args.rounds):
            for i, (kind, (task, embed)) in enumerate(KINDS.items()):
                reports[kind].append(run_kind(corpus, folder / f"{i}.parquet", models[kind], args.threads, task,
                                              embed))  # fmt: skip
                print(f"  {kind}: {reports[kind][-1][0].wall_s:.1f} s", flush=True)
        head = head_share(folder / "splade-mlm", texts[: args.head_batch], args.threads)
        st_sparse_s = sentence_transformers_sparse(splade, texts, args.threads)
        results = []
        for i, kind in enumerate(KINDS):
            report, whole = min(reports[kind], key=lambda r: r[0].wall_s)
            out = folder / f"{i}.parquet"
            result = {
                "kind": kind,
                "rows_per_s": args.rows / report.wall_s,
                "wall_s": report.wall_s,
                "whole_s": whole,
                "bytes_per_row": out.stat().st_size / args.rows,
                "bottleneck": report.bottleneck,
                "stages": {
                    s.get("stage", s.get("name", "?")): round(s.get("busy_s", s.get("seconds", 0.0)), 2)
                    for s in report.stages
                },  # fmt: skip
            }
            if kind.startswith("sparse"):
                lengths = pq.read_table(out, columns=["indices"]).column("indices").to_pylist()
                result["active_per_row"] = sum(len(x) for x in lengths) / len(lengths)
            results.append(result)
    base = results[0]
    print(f"{'kind':<18}{'rows/s':>9}{'x dense':>9}{'B/row':>11}{'x dense':>9}{'whole s':>9}")
    for r in results:
        print(f"{r['kind']:<18}{r['rows_per_s']:>9.1f}{r['rows_per_s'] / base['rows_per_s']:>9.2f}"
              f"{r['bytes_per_row']:>11.1f}{r['bytes_per_row'] / base['bytes_per_row']:>9.2f}"
              f"{r['whole_s']:>9.1f}")  # fmt: skip
    sparse = results[-1]
    print(f"sparse: {sparse['active_per_row']:.0f} entries per row; MLM head {head['head_share']:.0%} of the forward "
          f"({head['full_s'] * 1000:.0f} ms with it, {head['encoder_s'] * 1000:.0f} ms without, {head['rows']} rows, "
          f"{head['tokens']} tokens)")  # fmt: skip
    ratio = sparse["rows_per_s"] / base["rows_per_s"]
    tokens = head["tokens"] / head["rows"]  # a row's mean length, for attention's share
    encoder, mlm = encoder_flops(tokens), head_flops()
    ceiling = encoder / (encoder + mlm)
    print(f"per token: the encoder {encoder / 1e6:.1f} MFLOP, the MLM head {mlm / 1e6:.1f} MFLOP; sparse's "
          f"ceiling against dense (the same encoder, plus the head, at the same FLOP rate) {ceiling:.2f}x; "
          f"reached {ratio:.2f}x ({ratio / ceiling:.2f} of the ceiling)")  # fmt: skip
    print(f"compute stage: dense {base['stages']['compute']:.1f} s, sparse {sparse['stages']['compute']:.1f} s")
    st_rows_per_s = args.rows / st_sparse_s
    print(f"sentence-transformers SparseEncoder.encode (batch 32): {st_rows_per_s:.1f} rows/s; hpcinfer sparse "
          f"{sparse['rows_per_s'] / st_rows_per_s:.2f}x it")  # fmt: skip
    for r in results[1:]:
        if r["rows_per_s"] / base["rows_per_s"] < args.target:
            print(f"below {args.target}x dense: {r['kind']}: {where_time_goes(r['kind'], r, base, head)}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "rows": args.rows, "threads": args.threads, "head": head,
                                         "st_sparse_rows_per_s": st_rows_per_s, "results": results},
                                        indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
