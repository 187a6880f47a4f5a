"""`--quantize int8|auto` for the pooling tasks: the model in int8, checked on the job's own rows.

Before the run, the first `SAMPLE_ROWS` valid rows of the input (tokenized as the run will) go
through the float32 model and the int8 one. The report gives the cosine between the two outputs
(min and mean over the rows) and the time each took. `auto` keeps int8 only where it was faster
here and its min cosine reaches `--min-cosine`: int8 pays only on a CPU with int8 dot-product
instructions (VNNI, AMX), and a model whose outputs move too far is kept in float32. `int8` below
`--min-cosine` is refused: a kernel that is not accurate here is never used, whatever its speed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from ..config import RunConfig
from ..errors import ConfigError
from ..models.checkpoint import CheckpointInfo
from ..models.int8 import Int8Kernel
from ..models.int8_kernels import (
    accurate_kernels,
    available_engines,
    candidate_kernels,
    int8_problem,
    missing_int8_instructions,
    no_accurate_kernel,
    pick_kernel,
)
from ..models.int8_quantize import largest_weight, quantize_int8
from ..models.registry import LoadedModel, load_model, load_tokenizer
from .read import Reader
from .tokenize import TokenizeStage

# NOTE: the first SAMPLE_ROWS valid rows: every fifth calibrates int8 (64), the others (256) are held
# out and measure it. --min-cosine is checked on the held-out rows' minimum: with 256 of them, a row
# like them falls below that minimum with probability 1/257 at most (order statistics); 32 held-out
# rows promised 0.98 where 500 rows of the same input gave 0.977.
SAMPLE_ROWS = 320
CALIBRATE_EVERY = 5
TIMED_ROWS = 64  # auto times float32 and int8 on this many of the held-out rows
# NOTE: auto takes int8 only when it is this much faster than float32 on the sample: a near tie,
# whichever way the timing falls, always goes to float32
AUTO_MARGIN = 0.1


@dataclass(slots=True)
class Int8Check:
    """What the float32/int8 comparison on the job's rows found, and what the run uses."""

    chosen: str  # int8 | float32
    engine: str  # the int8 kernel (models/int8.Int8Kernel.name: onednn, fbgemm, onednn-7bit, ...)
    rows: int  # rows compared
    min_cosine: float
    mean_cosine: float
    p1_cosine: float  # the held-out rows' 1st percentile (the tail the minimum stands for)
    max_abs_diff: float
    float_ms: float  # the sample through the float32 model (its packed CPU path), best of two
    int8_ms: float
    reason: str  # why auto chose as it did ("" for --quantize int8)

    def line(self) -> str:
        quality = (
            f"cosine to float32 on {self.rows} held-out rows of the job's: min {self.min_cosine:.4f}, "
            f"1st percentile {self.p1_cosine:.4f}, mean {self.mean_cosine:.4f}"
        )
        speed = f"sample {self.float_ms:.0f} ms in float32, {self.int8_ms:.0f} ms in int8 ({self.engine})"
        chose = f"quantize: {self.chosen}" + (f" ({self.reason})" if self.reason else "")
        return f"{chose}; {quality}; {speed}" if self.reason else f"{chose} ({self.engine}); {quality}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_batch(config: RunConfig, info: CheckpointInfo, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first SAMPLE_ROWS valid rows of the input, tokenized as the run tokenizes them: (ids [rows,
    width], lengths)."""
    stage = TokenizeStage(
        load_tokenizer(info.path, max_length), max_length, info.config.vocab_size, "truncate", info.prompt
    )
    reader = Reader(replace(config.input, limit=SAMPLE_ROWS * 4, rate=None), window_rows=SAMPLE_ROWS * 4)
    rows: list[np.ndarray] = []
    for block in reader.produce():
        for tokens in stage.process(block):
            starts = np.cumsum(tokens.lengths) - tokens.lengths
            rows.extend(tokens.flat_ids[s : s + n] for s, n in zip(starts, tokens.lengths, strict=True))
        if len(rows) >= SAMPLE_ROWS:
            break
    rows = [r for r in rows[:SAMPLE_ROWS] if len(r)]
    if not rows:
        raise ConfigError("--quantize int8 compares against float32 on the input's rows, and it has none valid")
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.from_numpy(r.astype(np.int64))
    return ids, lengths


def _run_sorted(model: Any, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The rows through `model` in length-sorted batches of 16, as the run batches them (padding
    changes a batch's activation range, and so int8's precision): (outputs in row order, ms)."""
    order = torch.argsort(lengths)
    out: torch.Tensor | None = None
    start = time.perf_counter()
    for first in range(0, len(order), 16):
        rows = order[first : first + 16]
        width = int(lengths[rows].max())
        part = model(ids[rows, :width], lengths[rows]).float()
        if out is None:
            out = part.new_empty(len(order), part.shape[-1])
        out[rows] = part
    assert out is not None
    return out, (time.perf_counter() - start) * 1e3


@dataclass(slots=True)
class _Tried:
    kernel: Int8Kernel
    model: LoadedModel
    min_cosine: float
    mean_cosine: float
    p1_cosine: float  # the held-out rows' 1st percentile (the tail the minimum stands for)
    max_abs_diff: float


def int8_model(
    config: RunConfig, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, max_length: int
) -> tuple[LoadedModel, Int8Check]:
    """The model the run uses under --quantize int8|auto, and the comparison that chose it.

    Half the sample calibrates int8 (each layer's activation ranges set its smoothing); the
    cosine is taken on the other half, rows int8 has not seen. The accurate kernels (or the one
    --int8-kernel names) are tried fastest first, each on a float32 copy, until one keeps a min
    cosine of --min-cosine: a kernel under it is never used, whatever its speed. With none left,
    `int8` is refused in one line and `auto` keeps float32, saying why. Only `auto` also times the
    float32 path a run without --quantize takes.
    """
    if (problem := int8_problem(device, dtype)) is not None:
        if config.device.quantize == "auto" and accurate_kernels() == [] and available_engines():
            return _float32(config, info, device, dtype, no_accurate_kernel())
        raise ConfigError(problem)
    kernels = candidate_kernels(config.device.int8_kernel)
    ids, lengths = sample_batch(config, info, max_length)
    every = torch.arange(len(ids))
    calibration, held_out = every[every % CALIBRATE_EVERY == 0], every[every % CALIBRATE_EVERY != 0]
    if not len(held_out):
        calibration = held_out = every
    float_model = load_model(info, device, dtype, cpu_fast_path=False)
    reference, _ = _run_sorted(float_model.embedder, ids[held_out], lengths[held_out])
    if len(kernels) > 1:  # NOTE: fastest first, timed on the float weight; the next is tried only if it fails
        rows = config.plan.max_batch_tokens or 2048  # the int8 kernels are timed at a full batch
        first = pick_kernel(largest_weight(float_model.embedder), rows, kernels)
        kernels = [first] + [k for k in kernels if k != first]
    floor = config.device.min_cosine
    tried: list[_Tried] = []
    for kernel in kernels:
        quantized = float_model if not tried else load_model(info, device, dtype, cpu_fast_path=False)
        embedder = quantized.embedder
        quantize_int8(
            embedder, 1, kernel, calibrate=lambda e=embedder: _run_sorted(e, ids[calibration], lengths[calibration])
        )
        out, _ = _run_sorted(embedder, ids[held_out], lengths[held_out])
        cosine = torch.nn.functional.cosine_similarity(out, reference, dim=-1)
        tried.append(
            _Tried(
                kernel,
                quantized,
                round(float(cosine.min()), 6),
                round(float(cosine.mean()), 6),
                round(float(torch.quantile(cosine.double(), 0.01)), 6),
                float((out - reference).abs().max()),
            )
        )
        if tried[-1].min_cosine >= floor:
            break
    chosen = tried[-1]
    if chosen.min_cosine < floor:
        best = max(tried, key=lambda t: t.min_cosine)
        why = (
            f"int8's min cosine to float32 on {len(held_out)} held-out rows of the job's is {best.min_cosine:.4f} < "
            f"--min-cosine {floor:g} (kernels tried: {', '.join(f'{t.kernel.name} {t.min_cosine:.4f}' for t in tried)})"
        )
        if (missing := missing_int8_instructions()) and config.device.quantize == "int8":
            why += f"; {missing}"
        if config.device.quantize == "int8":
            raise ConfigError(f"--quantize int8 refused: {why}")
        return _float32(config, info, device, dtype, why, best, len(held_out))
    kernel = chosen.kernel
    check = Int8Check(
        "int8",
        kernel.name,
        len(held_out),
        chosen.min_cosine,
        chosen.mean_cosine,
        chosen.p1_cosine,
        chosen.max_abs_diff,
        0.0,
        0.0,
        "",
    )
    if config.device.quantize != "auto":
        return chosen.model, check
    fast_float = load_model(info, device, dtype)  # the float32 path a run without --quantize takes
    timed = held_out[:TIMED_ROWS]  # NOTE: speed needs fewer rows than the cosine's tail
    _run_sorted(fast_float.embedder, ids[timed[:16]], lengths[timed[:16]])  # NOTE: first passes build kernels
    check.float_ms = round(_run_sorted(fast_float.embedder, ids[timed], lengths[timed])[1], 2)
    check.int8_ms = round(_run_sorted(chosen.model.embedder, ids[timed], lengths[timed])[1], 2)
    if check.int8_ms >= (1 - AUTO_MARGIN) * check.float_ms:
        check.chosen, check.reason = "float32", f"int8 was not {1 / (1 - AUTO_MARGIN):.2f}x faster on this CPU"
    else:
        check.reason = f"{check.float_ms / check.int8_ms:.2f}x faster, min cosine >= {floor:g}"
    return (chosen.model if check.chosen == "int8" else fast_float), check


def _float32(
    config: RunConfig,
    info: CheckpointInfo,
    device: torch.device,
    dtype: torch.dtype,
    reason: str,
    best: _Tried | None = None,
    rows: int = 0,
) -> tuple[LoadedModel, Int8Check]:
    """`auto`'s float32 model where int8 is not accurate enough here, with the reason."""
    check = Int8Check(
        "float32",
        best.kernel.name if best else "",
        rows,
        best.min_cosine if best else 0.0,
        best.mean_cosine if best else 0.0,
        best.p1_cosine if best else 0.0,
        best.max_abs_diff if best else 0.0,
        0.0,
        0.0,
        reason,
    )
    return load_model(info, device, dtype), check


__all__ = ["AUTO_MARGIN", "SAMPLE_ROWS", "Int8Check", "int8_model", "sample_batch"]
