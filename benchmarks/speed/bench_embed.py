#!/usr/bin/env python
"""Embedding throughput: hpcinfer vs sentence-transformers vs a naive loop vs the compute ceiling.

Everything runs in one process on the same corpus and the same checkpoint (the packaged
all-MiniLM-L6-v2, `--model default`):

1. hpcinfer     `hpcinfer.api.run` end to end, Parquet output read back.
2. st bs=B      `SentenceTransformer.encode(texts, batch_size=B)` for each B in --st-batch-sizes.
3. naive bs=32  file order, HF AutoTokenizer + AutoModel, masked mean pooling + L2 normalisation.
4. ceiling      hpcinfer's native model on pre-tokenized, pre-padded device tensors cut into the
                batches hpcinfer's planner makes: forward + pooling only.

Every method is checked against sentence-transformers (batch 32) row by row (min cosine); the run
fails (exit 1) when any falls below --min-cosine.

Every method is set up and warmed up (untimed) first; then the timed runs go round robin, --repeats
rounds, each timed call on a fresh thread (hpcinfer computes on a thread of its own too); the best
round counts. All methods use the dtype hpcinfer resolves --dtype to.

Usage (from anywhere; paths default relative to the repository root):

    python benchmarks/speed/bench_embed.py [--rows N] [--device cpu|cuda|auto] [--repeats R] [--json out.json]
        [--model default|PATH]

On CUDA the report adds the device's busy share (the union of H2D, compute and D2H spans over the
wall time) and how much of the H2D copy time ran under compute (overlap), from hpcinfer's trace;
and each method's compute utilisation: the FLOPs of the real tokens (no padding: every linear
layer and each row's attention, benchmarks/gpu_check/gpu_models.py) over its wall time, against
--peak-tflops (989, an H200's dense bfloat16 peak).

The JSON (--json) is rewritten after every method's setup and timed run (temp + rename), with
"status": running until the end; a method that fails is recorded under "errors" and the others
go on; past --deadline S (seconds from the start) no new setup or timed run starts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # NOTE: runs from a checkout, installed or not

from benchmarks.gpu_check.gpu_models import H200_BF16_TFLOPS, forward_flops  # noqa: E402
from benchmarks.gpu_check.gpu_results import Deadline, add_deadline, attempt, write_json  # noqa: E402
from hpcinfer.api import run as hpcinfer_run  # noqa: E402
from hpcinfer.config import (  # noqa: E402
    DeviceConfig,
    InputConfig,
    OutputConfig,
    PipelineConfig,
    PlanConfig,
    RunConfig,
)
from hpcinfer.errors import HpcinferError  # noqa: E402
from hpcinfer.models.registry import inspect_embedder, load_model, load_tokenizer, resolve_model_path  # noqa: E402
from hpcinfer.obs.progress import Progress  # noqa: E402
from hpcinfer.pipeline.plan import cut_batches  # noqa: E402
from hpcinfer.pipeline.report import RunReport  # noqa: E402

DEFAULT_INPUT = REPO_ROOT / "sample_data" / "requests.parquet"
TEXT_COLUMN = "text"
ID_COLUMN = "id"
NAIVE_BATCH = 32
REFERENCE_BATCH = 32  # the sentence-transformers setting every method is compared with
HOST_STAGES = ("read", "tokenize", "plan", "stage", "write")
WARMUP_ROWS = 64
PLAN_FIELDS = ("sort_window", "max_batch_tokens", "max_batch_size", "pad_multiple")

LEGEND = """\
legend:
  wall s      best of --repeats rounds (methods run round robin); rows/s, tokens/s = rows, real tokens / wall.
  hpcinfer    wall = RunReport.wall_s: from the first read to the final output file (read, tokenize, plan,
              stage, compute, write the window parts, then assemble them into the output), overlapped.
              It excludes what api.run does before that: config, input and output checks, checkpoint
              inspection, model load (with CPU weight prepacking) and tokenizer load, buffer allocation.
              'whole call' is the api.run() call end to end.
  st bs=B     wall = one SentenceTransformer.encode() call on texts already in memory: tokenize +
              forward + pooling + normalise + to numpy (no file read, no write, no model load).
  naive       wall = the file-order loop on texts in memory: tokenize + forward + pool + copy to host.
  ceiling     wall = forward + pooling only of hpcinfer's own model (load_model, as api.run loads it), on
              ids already tokenized, padded and on the device, cut into the batches hpcinfer's planner
              makes with the plan hpcinfer resolved: what hpcinfer would reach if every host stage were free.
  real tokens = token lengths after truncation to the model's max_seq_length, the same for every method.
  pad eff     = real tokens / tokens actually fed to the model (rows x padded length, summed over batches).
  cores       = process CPU s / wall s in that round (hpcinfer: over the whole api.run() call). Near the
              intra-op thread count when the benchmark had the CPU to itself; well below it means other
              processes took CPU time and that figure is disturbed (on few cores, badly: OpenMP barriers).
  overlap     = (busy s of read+tokenize+plan+stage+write + busy s of compute) / hpcinfer wall;
              above 1.0 means host work ran concurrently with compute."""


@dataclass(slots=True)
class Corpus:
    texts: list[str]
    ids: list[Any]  # the id column, or the 0-based row number where there is none
    has_ids: bool
    source: Path


# --------------------------------------------------------------------------- corpus


def tiled(corpus: Corpus, times: int) -> Corpus:
    """The corpus `times` over, rows numbered afresh (ids must stay unique): enough steady work
    for a fast device, where one pass over a small file is mostly start-up and drain."""
    if times <= 1:
        return corpus
    texts = corpus.texts * times
    return Corpus(texts, list(range(len(texts))), False, corpus.source)


def parse_variants(text: str) -> list[dict[str, int]]:
    """'streams=1,graphs=0;streams=2,graphs=1' -> [{'streams': 1, 'graphs': 0}, ...]."""
    variants = []
    for part in filter(None, (x.strip() for x in text.split(";"))):
        fields = dict(kv.split("=", 1) for kv in part.split(","))
        unknown = set(fields) - {"streams", "graphs"}
        if unknown:
            raise ValueError(f"unknown variant field(s) {sorted(unknown)} in {part!r}")
        variants.append({"streams": int(fields.get("streams", 1)), "graphs": int(fields.get("graphs", 0))})
    return variants


def read_corpus(path: Path, rows: int | None) -> Corpus:
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        schema = pq.read_schema(path)
        columns = [c for c in (ID_COLUMN, TEXT_COLUMN) if c in schema.names]
        table = pq.read_table(path, columns=columns)
    elif suffix in (".jsonl", ".json", ".ndjson"):
        table = pj.read_json(path)
    else:
        raise SystemExit(f"bench_embed: unsupported input type {path} (expected .parquet or .jsonl)")
    if TEXT_COLUMN not in table.column_names:
        raise SystemExit(f"bench_embed: {path} has no '{TEXT_COLUMN}' column")
    if rows is not None:
        table = table.slice(0, rows)
    texts = table.column(TEXT_COLUMN).to_pylist()
    has_ids = ID_COLUMN in table.column_names
    ids = table.column(ID_COLUMN).to_pylist() if has_ids else list(range(len(texts)))
    return Corpus(texts, ids, has_ids, path)


def write_subset(corpus: Corpus, n: int, path: Path) -> Path:
    """The first n rows as a Parquet file hpcinfer can read (id column only when the input has one)."""
    columns: dict[str, pa.Array] = {}
    if corpus.has_ids:
        columns[ID_COLUMN] = pa.array(corpus.ids[:n])
    columns[TEXT_COLUMN] = pa.array(corpus.texts[:n], pa.string())
    pq.write_table(pa.table(columns), path)
    return path


# --------------------------------------------------------------------------- helpers


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def tokenizer_parallelism() -> str:
    """TOKENIZERS_PARALLELISM as the tokenizer sees it: unset, the Rust thread pool is on."""
    return os.environ.get("TOKENIZERS_PARALLELISM", "unset (on)")


def describe_load() -> str:
    load = load_average()
    if load is None:
        return "unknown"
    return f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count() or 1} cores"


def cpu_busy_now(sample_s: float = 1.0) -> float | None:
    """Cores busy machine-wide over the next sample_s seconds (from /proc/stat); None where unknown.
    Called while this process is idle, it measures what other processes use."""

    def read() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values[:8]), idle

    try:
        total0, idle0 = read()
        time.sleep(sample_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total) if total > 0 else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def in_fresh_thread(fn: Callable[[], Any]) -> Any:
    """Runs fn on a new thread and returns its result (re-raising its exception).

    hpcinfer computes on a thread of its own, never on the caller's; every other method is run the
    same way, so that all of them meet the same threading conditions. (On a CPU shared with other
    processes, OpenMP work issued from the main thread was seen to slow down far more than the
    same work issued from a fresh thread.)
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["exc"] = exc

    thread = threading.Thread(target=target, name="bench-timed", daemon=True)
    thread.start()
    thread.join()
    if "exc" in box:
        raise box["exc"]
    return box.get("out")


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, float, Any]:
    """(wall s, cores busy = process CPU s / wall s, result); fn runs on a fresh thread."""
    sync(device)
    c0, t0 = time.process_time(), time.perf_counter()
    out = in_fresh_thread(fn)
    sync(device)
    wall = time.perf_counter() - t0
    return wall, (time.process_time() - c0) / wall if wall > 0 else 0.0, out


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cos = (a64 * b64).sum(1) / np.maximum(np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1), 1e-300)
    return float(cos.min())


def padded_in_order(lengths: np.ndarray, order: np.ndarray, batch_size: int) -> int:
    """Tokens fed to the model when rows go in `order`, cut every batch_size, padded to their longest."""
    sorted_lengths = lengths[order]
    return sum(
        len(chunk) * int(chunk.max())
        for chunk in (sorted_lengths[i : i + batch_size] for i in range(0, len(order), batch_size))
    )


def st_padded_tokens(texts: Sequence[str], lengths: np.ndarray, batch_size: int, flattened: bool) -> int:
    """What sentence-transformers pads: it sorts by character length, longest first (the very same
    np.argsort call), then pads each batch of batch_size to its longest tokenized row; with
    flattened inputs (flash-attention varlen) nothing is padded."""
    if flattened:
        return int(lengths.sum())
    order = np.argsort([-len(t) for t in texts])
    return padded_in_order(lengths, order, batch_size)


# --------------------------------------------------------------------------- the methods


class Method:
    """One benchmarked method: set up (and warmed up) once, then timed once per round."""

    name = ""

    def __init__(self) -> None:
        self.walls_s: list[float] = []
        self.cores: list[float] = []  # process CPU s / wall s, per round
        self.padded_tokens = 0
        self.embeddings: np.ndarray | None = None  # [rows, dim] in input order, from the latest round
        self.extra: dict[str, Any] = {}

    @property
    def wall_s(self) -> float:
        return min(self.walls_s)

    @property
    def best_cores(self) -> float:
        return self.cores[int(np.argmin(self.walls_s))]

    def record(self, wall: float, cores: float, more: str = "") -> None:
        self.walls_s.append(wall)
        self.cores.append(cores)
        print(f"  {self.name:<14} {wall:9.3f} s  cores busy {cores:4.2f} {more}".rstrip(), flush=True)

    def once(self) -> float:
        raise NotImplementedError


# --------------------------------------------------------------------------- 1. hpcinfer


def hpcinfer_config(
    input_path: Path,
    output: Path,
    args: argparse.Namespace,
    plan: PlanConfig,
    trace: Path | None = None,
    variant: dict[str, int] | None = None,
) -> RunConfig:
    variant = variant or {"streams": 1, "graphs": 0}
    return RunConfig(
        input=InputConfig(paths=(str(input_path),)),
        model=args.model,
        trace_path=str(trace) if trace is not None else None,
        plan=plan,
        device=DeviceConfig(
            device=args.device, dtype=args.dtype, streams=variant["streams"], cuda_graphs=bool(variant["graphs"])
        ),
        output=OutputConfig(path=str(output), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
    )


def read_embeddings(path: Path) -> tuple[list[Any], np.ndarray]:
    table = pq.read_table(path)
    column = table.column("embedding").combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return table.column("id").to_pylist(), values.reshape(table.num_rows, -1)


def resolved_plan(report: RunReport, requested: PlanConfig) -> PlanConfig:
    """The plan a run actually used (defaults such as the per-device token budget filled in), from its report."""
    values = {k: report.config.get(f"plan.{k}", getattr(requested, k)) for k in PLAN_FIELDS}
    return replace(requested, **values)


class HpcinferMethod(Method):
    name = "hpcinfer"

    def __init__(
        self,
        corpus: Corpus,
        input_path: Path,
        tmp: Path,
        args: argparse.Namespace,
        plan: PlanConfig,
        variant: dict[str, int] | None = None,
    ):
        super().__init__()
        self.corpus, self.input_path, self.args, self.plan = corpus, input_path, args, plan
        self.variant = variant or {"streams": 1, "graphs": 0}
        if variant is not None:
            self.name = f"hpcinfer s{self.variant['streams']}{' graphs' if self.variant['graphs'] else ''}"
        self.tmp = tmp / self.name.replace(" ", "_")
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.whole_s: list[float] = []
        self.device = torch.device(args.device)
        self.best: RunReport | None = None
        self.device_figures: dict[str, float] = {}
        self.extra["ids_match"] = True
        # Warm-up (untimed): a small run pays the one-off costs (kernel selection, thread pools) and
        # tells which dtype hpcinfer resolves --dtype to.
        warm_input = write_subset(corpus, min(WARMUP_ROWS, len(corpus.texts)), tmp / "warmup.parquet")
        warm_config = hpcinfer_config(warm_input, self.tmp / "warmup.out.parquet", args, plan, variant=self.variant)
        warm = hpcinfer_run(warm_config, progress=Progress(mode="off"))
        self.dtype = warm.dtype
        self.resolved_plan = resolved_plan(warm, plan)

    def once(self) -> float:
        out = self.tmp / "hpcinfer.out.parquet"
        config = hpcinfer_config(self.input_path, out, self.args, self.plan, self.tmp / "trace.json", self.variant)
        whole, cores, report = timed(lambda: hpcinfer_run(config, progress=Progress(mode="off")), self.device)
        self.whole_s.append(whole)
        self.record(report.wall_s, cores, f"(whole api.run() call {whole:.3f} s)")
        if self.best is None or report.wall_s <= self.best.wall_s:
            self.best = report
            self.device_figures = device_figures(self.tmp / "trace.json", report.wall_s)
        self.padded_tokens = report.padded_tokens
        ids, self.embeddings = read_embeddings(out)
        self.extra["ids_match"] = self.extra["ids_match"] and ids == self.corpus.ids
        return report.wall_s


# --------------------------------------------------------------------------- 2. sentence-transformers


def load_sentence_transformer(model_path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, bool]:
    """The model, warmed up, and whether it flattens (unpads) text inputs."""
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = SentenceTransformer(str(model_path), device=str(device))
    model_type = json.loads((model_path / "config.json").read_text(encoding="utf-8")).get("model_type")
    if model_type in ("qwen2", "qwen3"):
        # NOTE: for these model types AutoTokenizer builds its own Qwen2 tokenizer class over the
        # files, which splits the random checkpoints' WordPiece vocabulary (MiniLM's tokenizer.json)
        # differently; the tokenizer.json itself, as hpcinfer reads it, is the same for both
        import transformers

        model[0].processor = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(model_path / "tokenizer.json"), pad_token="[PAD]", model_max_length=model.max_seq_length
        )
    if dtype != torch.float32:
        model = model.to(dtype)
    can_flatten = getattr(model, "_can_flatten_inputs", None)
    flattened = bool(can_flatten()) if callable(can_flatten) else False
    in_fresh_thread(  # warm-up, untimed
        lambda: model.encode(["warm-up"] * 8, batch_size=8, convert_to_numpy=True, show_progress_bar=False)
    )
    return model, flattened


class SentenceTransformersMethod(Method):
    def __init__(
        self, model: Any, flattened: bool, corpus: Corpus, lengths: np.ndarray, device: torch.device, batch_size: int
    ):
        super().__init__()
        self.name = f"st bs={batch_size}"
        self.model, self.texts, self.device, self.batch_size = model, corpus.texts, device, batch_size
        self.padded_tokens = st_padded_tokens(corpus.texts, lengths, batch_size, flattened)
        self.extra["batch_size"] = batch_size

    def encode(self) -> np.ndarray:
        out = self.model.encode(self.texts, batch_size=self.batch_size, convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32)

    def once(self) -> float:
        wall, cores, self.embeddings = timed(self.encode, self.device)
        self.record(wall, cores)
        return wall


# --------------------------------------------------------------------------- 3. naive loop


class NaiveMethod(Method):
    name = f"naive bs={NAIVE_BATCH}"

    def __init__(
        self,
        corpus: Corpus,
        lengths: np.ndarray,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int,
    ):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModel.from_pretrained(str(model_path)).to(device=device, dtype=dtype).eval()
        self.texts, self.lengths, self.device, self.max_length = corpus.texts, lengths, device, max_length
        self.extra["padded_expected"] = padded_in_order(lengths, np.arange(len(lengths)), NAIVE_BATCH)
        in_fresh_thread(lambda: self.loop(self.texts[:NAIVE_BATCH]))  # warm-up, untimed

    def loop(self, texts: list[str]) -> tuple[np.ndarray, int, np.ndarray]:
        outs, fed, seen = [], 0, []
        with torch.inference_mode():
            for i in range(0, len(texts), NAIVE_BATCH):
                enc = self.tokenizer(
                    texts[i : i + NAIVE_BATCH],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                fed += enc["input_ids"].numel()
                seen.append(enc["attention_mask"].sum(1))
                enc = enc.to(self.device)
                hidden = self.model(**enc).last_hidden_state.float()
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
                outs.append(F.normalize(pooled, p=2, dim=1).cpu())
        return torch.cat(outs).numpy(), fed, torch.cat(seen).numpy()

    def once(self) -> float:
        wall, cores, (self.embeddings, self.padded_tokens, seen) = timed(lambda: self.loop(self.texts), self.device)
        self.extra["hf_lengths_match"] = bool(np.array_equal(seen, self.lengths))
        self.record(wall, cores)
        return wall


# --------------------------------------------------------------------------- 4. compute ceiling


def plan_batches(lengths: np.ndarray, plan: PlanConfig) -> list[tuple[np.ndarray, int]]:
    """hpcinfer's batches: windows of exactly sort_window input rows, each cut by cut_batches."""
    assert plan.max_batch_tokens is not None, "pass the plan hpcinfer resolved"
    batches = []
    for start in range(0, len(lengths), plan.sort_window):
        window = lengths[start : start + plan.sort_window]
        for rows, width in cut_batches(window, plan.max_batch_tokens, plan.max_batch_size, plan.pad_multiple):
            batches.append((rows.astype(np.int64) + start, width))
    return batches


class CeilingMethod(Method):
    name = "ceiling"

    def __init__(
        self,
        token_ids: list[list[int]],
        lengths: np.ndarray,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        plan: PlanConfig,
    ):
        super().__init__()
        self.embedder = load_model(inspect_embedder(model_path), device, dtype).embedder
        self.device, self.rows = device, len(lengths)
        pad_id = 0  # as hpcinfer's stage step pads
        self.batches: list[tuple[np.ndarray, torch.Tensor, torch.Tensor, bool]] = []
        for rows, width in plan_batches(lengths, plan):
            ids = np.full((len(rows), width), pad_id, dtype=np.int32)
            for j, r in enumerate(rows):
                ids[j, : lengths[r]] = token_ids[r]
            row_lengths = lengths[rows].astype(np.int32)
            padded = bool(row_lengths.min() < width)
            self.batches.append(
                (rows, torch.from_numpy(ids).to(device), torch.from_numpy(row_lengths).to(device), padded)
            )
            self.padded_tokens += len(rows) * width
        self.extra["batches"] = len(self.batches)
        _, ids, row_lengths, padded = self.batches[-1]  # warm-up on the smallest batch, untimed
        in_fresh_thread(lambda: self.embedder(ids, row_lengths, padded))

    def loop(self) -> list[torch.Tensor]:
        return [self.embedder(ids, lengths, padded) for _, ids, lengths, padded in self.batches]

    def once(self) -> float:
        wall, cores, outs = timed(self.loop, self.device)
        self.record(wall, cores)
        emb = np.empty((self.rows, self.embedder.output_dim), dtype=np.float32)
        for (rows, *_), out in zip(self.batches, outs, strict=True):
            emb[rows] = out.float().cpu().numpy()
        self.embeddings = emb
        return wall


# --------------------------------------------------------------------------- report


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length covered by both unions (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def device_figures(trace: Path, wall_s: float) -> dict[str, float]:
    """From hpcinfer's trace: the device's busy share of the wall time, and the H2D time hidden under compute."""
    events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    spans: dict[str, list[tuple[float, float]]] = {"h2d": [], "compute": [], "d2h": []}
    for e in events:
        if e.get("ph") == "X" and e["name"] in spans:
            spans[e["name"]].append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    busy = _union([s for name in spans for s in spans[name]])
    h2d, compute = _union(spans["h2d"]), _union(spans["compute"])
    h2d_s = sum(end - start for start, end in h2d)
    return {
        "device_busy_share": sum(end - start for start, end in busy) / wall_s if wall_s else 0.0,
        "h2d_s": h2d_s,
        "h2d_under_compute": _intersection(h2d, compute) / h2d_s if h2d_s else 0.0,
    }


def overlap_figures(report: RunReport) -> dict[str, float]:
    stages = {s["stage"]: s for s in report.stages}
    host = sum(float(stages[name]["busy_s"]) for name in HOST_STAGES if name in stages)
    compute = float(stages.get("compute", {}).get("busy_s", 0.0))
    return {
        "host_busy_s": host,
        "compute_busy_s": compute,
        "overlap": (host + compute) / report.wall_s if report.wall_s else 0.0,
        "compute_share": float(stages.get("compute", {}).get("share", 0.0)),
    }


def table_rows(methods: list[Method], rows: int, real_tokens: int, best_st: Method | None) -> list[dict]:
    table = []
    for r in methods:
        table.append(
            {
                "method": r.name,
                "rows_per_s": rows / r.wall_s,
                "tokens_per_s": real_tokens / r.wall_s,
                "padding_efficiency": real_tokens / r.padded_tokens if r.padded_tokens else 1.0,
                "padded_tokens": r.padded_tokens,
                "wall_s": r.wall_s,
                "walls_s": r.walls_s,
                "vs_best_st": best_st.wall_s / r.wall_s if best_st is not None else None,
                "cores_busy": r.best_cores,
                "cores_busy_per_round": r.cores,
            }
        )
    return table


def print_table(
    methods: list[Method], rows: int, real_tokens: int, best_st: Method, flops: float, peak_tflops: float | None
) -> None:
    header = (
        f"{'method':<20} {'rows/s':>10} {'tokens/s':>12} {'pad eff':>8} {'wall s':>9} {'cores':>6} {'vs best ST':>11}"
        f" {'TFLOP/s':>8} {'of peak':>8}"
    )
    print(header)
    print("-" * len(header))
    for r, entry in zip(methods, table_rows(methods, rows, real_tokens, best_st), strict=True):
        work = compute_figures(r, flops, peak_tflops)
        share = f"{work['compute_utilisation']:.1%}" if work["compute_utilisation"] is not None else "-"
        print(
            f"{r.name:<20} {entry['rows_per_s']:>10,.1f} {entry['tokens_per_s']:>12,.0f} "
            f"{entry['padding_efficiency']:>8.3f} {r.wall_s:>9.3f} {r.best_cores:>6.2f} {entry['vs_best_st']:>10.2f}x"
            f" {work['tflops']:>8.2f} {share:>8}"
        )


def describe_plan(plan: PlanConfig) -> str:
    return ", ".join(f"{k} {getattr(plan, k) if getattr(plan, k) is not None else 'auto'}" for k in PLAN_FIELDS)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", type=Path, default=DEFAULT_INPUT, help="corpus (.parquet or .jsonl with a 'text' column)")
    p.add_argument("--rows", type=int, default=None, help="use only the first N rows")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--dtype", default="auto", help="passed to hpcinfer; every other method uses what it resolves to")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per method (the best is reported)")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    p.add_argument("--st-batch-sizes", default="8,16,32,64,128", help="comma-separated sentence-transformers sizes")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="override hpcinfer's PlanConfig default")
    p.add_argument("--min-cosine", type=float, default=0.9999, help="fail below this min cosine vs ST (bs=32)")
    p.add_argument("--model", default="default", help="'default' (the packaged model) or a checkpoint directory")
    p.add_argument("--tile", type=int, default=1, help="repeat the corpus this many times (steady work on a GPU)")
    p.add_argument(
        "--variants",
        default=None,
        help="hpcinfer settings to compare, e.g. 'streams=1,graphs=0;streams=2,graphs=1' (default: one run as is)",
    )
    p.add_argument("--skip", default="", help="comma-separated methods to leave out: naive, ceiling")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help=f"the device's peak for compute utilisation (default on CUDA: {H200_BF16_TFLOPS:g}, an H200's bf16)",
    )
    add_deadline(p)
    args = p.parse_args(argv)
    if args.tile < 1:
        p.error("--tile must be at least 1")
    args.skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if args.skip - {"naive", "ceiling"}:
        p.error("--skip takes naive and/or ceiling")
    try:
        args.variants = parse_variants(args.variants) if args.variants else None
    except ValueError as exc:
        p.error(f"--variants: {exc}")
    if args.rows is not None and args.rows < 1:
        p.error("--rows must be at least 1")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        args.st_batch_sizes = [int(x) for x in args.st_batch_sizes.split(",") if x.strip()]
    except ValueError:
        p.error("--st-batch-sizes must be comma-separated integers")
    if not args.st_batch_sizes or min(args.st_batch_sizes) < 1:
        p.error("--st-batch-sizes needs at least one positive size")
    return args


def reference_of(st_methods: list[SentenceTransformersMethod]) -> SentenceTransformersMethod | None:
    """st at REFERENCE_BATCH where it ran, else the smallest batch that did (any batch size gives the
    same embeddings to within padding noise; no extra pass over the corpus)."""
    ran = [m for m in st_methods if m.embeddings is not None]
    return next((m for m in ran if m.batch_size == REFERENCE_BATCH), None) or min(
        ran, key=lambda m: m.batch_size, default=None
    )


def compute_figures(method: Method, flops: float, peak_tflops: float | None) -> dict[str, float | None]:
    """The useful work's rate (FLOPs of the real tokens, no padding) and its share of the peak."""
    tflops = flops / method.wall_s / 1e12
    return {"tflops": tflops, "compute_utilisation": tflops / peak_tflops if peak_tflops else None}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = Deadline(args.deadline)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    input_path = args.input if args.input.is_absolute() else (Path.cwd() / args.input)
    if not input_path.is_file():
        input_path = REPO_ROOT / args.input  # a relative path may also be meant from the repository root
    corpus = tiled(read_corpus(input_path, args.rows), args.tile)
    n = len(corpus.texts)
    if n == 0:
        raise SystemExit("bench_embed: the corpus has no rows")
    plan = PlanConfig()
    if args.max_batch_tokens is not None:
        plan = replace(plan, max_batch_tokens=args.max_batch_tokens)

    model_path = resolve_model_path(args.model)
    info = inspect_embedder(model_path)
    max_length = info.max_seq_length
    tokenizer = load_tokenizer(model_path, max_length)
    t0 = time.perf_counter()
    encodings = tokenizer.encode_batch(corpus.texts, add_special_tokens=True)
    tokenize_s = time.perf_counter() - t0
    token_ids = [e.ids for e in encodings]
    lengths = np.fromiter((len(t) for t in token_ids), dtype=np.int32, count=n)
    real_tokens = int(lengths.sum())
    model_config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    flops = forward_flops(model_config, lengths)
    peak_tflops = (
        args.peak_tflops if args.peak_tflops is not None else (H200_BF16_TFLOPS if device.type == "cuda" else None)
    )

    print("bench_embed: hpcinfer vs sentence-transformers vs naive loop vs compute ceiling")
    print(f"  corpus      {corpus.source.name}: {n:,} rows, {real_tokens:,} real tokens (max_length {max_length})")
    print(f"  tokenizer   {tokenize_s:.2f} s for the corpus (TOKENIZERS_PARALLELISM={tokenizer_parallelism()})")
    print(f"  model       {model_path.name} ({model_path.parent.name}), {flops / n / 1e9:.2f} GFLOP a row")
    print(f"  cpu         {cpu_model()}")
    print(
        f"  torch       {torch.__version__}, intra-op threads {torch.get_num_threads()}, "
        f"inter-op threads {torch.get_num_interop_threads()}"
    )
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"  device      {device}{gpu}")
    print(f"  plan        {describe_plan(plan)} (requested)")
    print(f"  repeats     {args.repeats} (best reported)")
    busy = cpu_busy_now()
    warning = "   WARNING: other processes are using the CPU; timings will be disturbed" if busy and busy > 0.25 else ""
    print(f"  other load  {'unknown' if busy is None else f'{busy:.2f} cores busy'} (1 s sample){warning}")
    print(f"  load avg    {describe_load()}")
    sys.stdout.flush()

    environment = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "device": str(device) + gpu,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "tokenizers_parallelism": tokenizer_parallelism(),
        "tokenize_s": tokenize_s,
        "other_cores_busy_at_start": busy,
    }
    corpus_info = {"path": str(corpus.source), "rows": n, "real_tokens": real_tokens, "max_length": max_length}
    work = {"model": str(model_path.name), "flops": flops, "flops_per_row": flops / n, "peak_tflops": peak_tflops}
    methods: list[Method] = []
    errors: dict[str, dict[str, Any]] = {}  # method -> its error, or why it was skipped

    def table_now() -> list[dict[str, Any]]:
        done = [m for m in methods if m.walls_s]
        sts = [m for m in done if isinstance(m, SentenceTransformersMethod)]
        best_st = min(sts, key=lambda m: m.wall_s, default=None)
        rows = table_rows(done, n, real_tokens, best_st)
        for row, m in zip(rows, done, strict=True):
            row |= compute_figures(m, flops, peak_tflops)
            if isinstance(m, HpcinferMethod):
                row |= {"variant": m.variant, **m.device_figures}
        return rows

    def save(status: str, **more: Any) -> None:
        if args.json is not None:
            data = {"status": status, "corpus": corpus_info, "environment": environment, "work": work}
            data |= {"repeats": args.repeats, "methods": table_now(), "errors": errors, **more}
            write_json(args.json, data)

    def guarded(name: str, fn: Callable[[], Any]) -> Any:
        out, failed = attempt(name, fn, deadline)
        if failed is not None:
            errors[name] = failed
        save("running")
        return out

    save("running")
    with tempfile.TemporaryDirectory(prefix="bench_embed-") as tmp_name:
        tmp = Path(tmp_name)
        needs_subset = args.rows is not None or args.tile > 1 or input_path.suffix.lower() not in (".parquet", ".pq")
        hpc_input = write_subset(corpus, n, tmp / "input.parquet") if needs_subset else input_path
        print("setting up and warming up every method (untimed) ...", flush=True)
        hpcs: list[HpcinferMethod] = []
        for variant in args.variants or [None]:
            label = "hpcinfer" if variant is None else f"hpcinfer s{variant['streams']} graphs {variant['graphs']}"
            made = guarded(label, lambda v=variant: HpcinferMethod(corpus, hpc_input, tmp, args, plan, v))
            hpcs += [made] if made is not None else []
        if not hpcs:
            print("FAIL: no hpcinfer setting could be set up", file=sys.stderr)
            save("failed")
            return 1
        dtype: torch.dtype = getattr(torch, hpcs[0].dtype)
        environment["dtype"] = hpcs[0].dtype
        plan = hpcs[0].resolved_plan
        print(f"  dtype       {hpcs[0].dtype} (hpcinfer --dtype {args.dtype}; used by every method)")
        print(f"  plan        {describe_plan(plan)} (as hpcinfer resolved it; the ceiling uses it)", flush=True)
        loaded = guarded("sentence-transformers", lambda: load_sentence_transformer(model_path, device, dtype))
        st_methods = [
            SentenceTransformersMethod(loaded[0], loaded[1], corpus, lengths, device, bs)
            for bs in (args.st_batch_sizes if loaded is not None else [])
        ]
        naive = ceiling = None
        if "naive" not in args.skip:
            naive = guarded("naive", lambda: NaiveMethod(corpus, lengths, model_path, device, dtype, max_length))
        if "ceiling" not in args.skip:
            ceiling = guarded("ceiling", lambda: CeilingMethod(token_ids, lengths, model_path, device, dtype, plan))
        methods += [*hpcs, *st_methods, *(m for m in (naive, ceiling) if m is not None)]
        # Round robin, so that a disturbance (another process, thermal) spreads over every method.
        for round_no in range(args.repeats):
            print(f"round {round_no + 1}/{args.repeats} (wall s):", flush=True)
            for method in methods:
                if method.name not in errors:  # NOTE: a method that failed once is not run again
                    guarded(method.name, method.once)

    st_methods = [m for m in st_methods if m.walls_s]
    hpcs = [m for m in hpcs if m.walls_s and m.best is not None]
    reference_method = reference_of(st_methods)
    failures = [f"{name}: {e.get('error', e.get('reason'))}" for name, e in errors.items()]
    if not hpcs or reference_method is None:
        failures.append("no hpcinfer setting or no sentence-transformers batch size was measured")
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        save("failed", checks={"failures": failures, "notes": []})
        return 1
    reference, reference_batch = reference_method.embeddings, reference_method.batch_size
    hpc = min(hpcs, key=lambda m: m.wall_s)  # the summary speaks of the fastest setting
    assert reference is not None and hpc.best is not None
    report = hpc.best

    # ---- checks
    failures += [f"{m.name}: output ids do not follow the input ids" for m in hpcs if not m.extra["ids_match"]]
    if report.rows != n:
        failures.append(f"hpcinfer wrote {report.rows} rows, expected {n}")
    if report.real_tokens != real_tokens:
        failures.append(f"hpcinfer counted {report.real_tokens} real tokens, the benchmark {real_tokens}")
    if naive is not None and "hf_lengths_match" in naive.extra and not naive.extra["hf_lengths_match"]:
        failures.append("the HF tokenizer's lengths differ from hpcinfer's tokenizer")
    notes = []
    if ceiling is not None and ceiling.walls_s and report.padded_tokens != ceiling.padded_tokens:
        notes.append(
            f"note: hpcinfer padded {report.padded_tokens:,} tokens, the ceiling's reproduced plan "
            f"{ceiling.padded_tokens:,} (windowing differs)"
        )
    final_budget = getattr(report, "final_max_batch_tokens", 0)  # absent from older reports
    if final_budget and final_budget != plan.max_batch_tokens:
        notes.append(
            f"note: hpcinfer lowered its token budget to {final_budget} (out-of-memory splits: "
            f"{getattr(report, 'oom_splits', '?')}); the ceiling kept {plan.max_batch_tokens}"
        )
    if getattr(report, "rejects", None):
        failures.append(f"hpcinfer rejected rows: {report.rejects}")
    if naive is not None and naive.walls_s and naive.padded_tokens != naive.extra["padded_expected"]:
        notes.append(f"note: naive fed {naive.padded_tokens:,} tokens, expected {naive.extra['padded_expected']:,}")
    cosines = {m.name: min_cosine(m.embeddings, reference) for m in methods if m.embeddings is not None}

    # ---- report
    best_st = min(st_methods, key=lambda m: m.wall_s)
    measured = [m for m in methods if m.walls_s]
    print()
    print_table(measured, n, real_tokens, best_st, flops, peak_tflops)
    print()
    print(f"min cosine vs st bs={reference_batch} (per row, threshold {args.min_cosine}):")
    for name, cos in cosines.items():
        flag = "" if cos >= args.min_cosine else "   FAIL"
        print(f"  {name:<14} {cos:.7f}{flag}")
        if cos < args.min_cosine:
            failures.append(f"{name}: min cosine {cos:.7f} < {args.min_cosine}")
    print()
    ov = overlap_figures(report)
    print(
        f"hpcinfer wall (report.wall_s, excludes model load): {report.wall_s:.3f} s; "
        f"whole api.run() call incl. model load: {min(hpc.whole_s):.3f} s"
    )
    print(
        "hpcinfer stages (busy s / share of wall):  "
        + ", ".join(f"{s['stage']} {s['busy_s']:.2f}/{s['share']:.2f}" for s in report.stages)
    )
    print(f"hpcinfer bottleneck: {report.bottleneck} ({report.hint})")
    ratio_st = hpc.wall_s and best_st.wall_s / hpc.wall_s
    ratio_ceiling = ceiling.wall_s / hpc.wall_s if ceiling is not None and ceiling.walls_s else float("nan")
    print(f"hpcinfer / best sentence-transformers (bs={best_st.extra['batch_size']}): {ratio_st:.2f}x ({hpc.name})")
    for m in hpcs:
        print(f"  {m.name:<22} {n / m.wall_s:>12,.1f} rows/s   {best_st.wall_s / m.wall_s:.2f}x best st")
    print(f"hpcinfer / compute ceiling: {ratio_ceiling:.2f}x")
    print(
        f"hpcinfer overlap: {ov['overlap']:.2f} (host busy {ov['host_busy_s']:.2f} s + compute busy "
        f"{ov['compute_busy_s']:.2f} s over wall {report.wall_s:.2f} s); compute share {ov['compute_share']:.2f}"
    )
    dev = hpc.device_figures
    print(
        f"hpcinfer device: busy {dev['device_busy_share']:.2f} of wall (union of h2d, compute and d2h spans); "
        f"H2D under compute {dev['h2d_under_compute']:.2f} of {dev['h2d_s']:.3f} s of H2D"
    )
    print(f"rows/s: hpcinfer {n / hpc.wall_s:,.1f}, best sentence-transformers {n / best_st.wall_s:,.1f}")
    print(f"load avg at end (this benchmark's own threads included): {describe_load()}")
    for line in notes:
        print(line)
    print()
    print(LEGEND)

    environment["load_average_end"] = load_average()
    summary = {
        "best_st_batch_size": best_st.extra["batch_size"],
        "fastest_hpcinfer": hpc.name,
        "hpcinfer_variants": {m.name: {**m.variant, "rows_per_s": n / m.wall_s} for m in hpcs},
        "hpcinfer_over_best_st": ratio_st,
        "hpcinfer_over_ceiling": ratio_ceiling,
        "hpcinfer_whole_call_s": hpc.whole_s,
        **compute_figures(hpc, flops, peak_tflops),
        **ov,
        **hpc.device_figures,
    }
    save(
        "done" if not failures else "failed",
        plan={k: getattr(plan, k) for k in PLAN_FIELDS},
        min_cosine_vs_st={"batch_size": reference_batch, **cosines},
        summary=summary,
        hpcinfer_report=report.to_dict(),
        checks={"failures": failures, "notes": notes},
    )
    if args.json is not None:
        print(f"\nfigures written to {args.json}")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HpcinferError as exc:  # a bad flag combination (e.g. --max-batch-tokens below one row): no traceback
        print(f"bench_embed: hpcinfer error: {exc}", file=sys.stderr)
        sys.exit(2)
