"""The GPU check's models, built from configs with random weights (no weights travel to the GPU
machine), and what one pass of each costs: FLOPs for compute utilisation, bytes for bandwidth.

Shapes (the real models' config.json, MiniLM's WordPiece tokenizer from benchmarks/minilm_tokenizer):
- `llama-1b`: Llama-3.2-1B, 1.24B parameters with its 128,256-token vocabulary (tied LM head);
- `bert-large`: BERT-large (335M), mean pooling, 512 positions;
- `qwen3-0.6b`: Qwen3-Embedding-0.6B's decoder (last-token pooling), the tokenizer's vocabulary;
- `tiny-*`: the same architectures at a few MB, for the dry run on the CPU.

Random weights cost what trained ones do: every FLOP and byte is the same.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "benchmarks" / "minilm_tokenizer"

H200_BF16_TFLOPS = 989.0  # dense bfloat16 tensor-core peak (H100/H200 SXM datasheet)
H200_TBPS = 4.8  # HBM3e bandwidth (H200 datasheet)

DECODERS: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "architecture": "LlamaForCausalLM",
        "hidden": 2048,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "intermediate": 8192,
        "tie": True,
        "rope_theta": 500000.0,
        "vocab": 128256,
        "max_positions": 2048,
    },
    "tiny-llama": {
        "architecture": "LlamaForCausalLM",
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "tie": True,
        "vocab": 4096,
        "max_positions": 512,
    },
}
EMBEDDERS: dict[str, dict[str, Any]] = {
    "bert-large": {"kind": "bert", "hidden": 1024, "layers": 24, "heads": 16, "intermediate": 4096},
    "qwen3-0.6b": {
        "kind": "decoder",
        "architecture": "Qwen3ForCausalLM",
        "hidden": 1024,
        "layers": 28,
        "heads": 16,
        "kv_heads": 8,
        "head_dim": 128,
        "intermediate": 3072,
        "tie": True,
        "rope_theta": 1000000.0,
    },
    "tiny-bert": {"kind": "bert", "hidden": 64, "layers": 2, "heads": 4, "intermediate": 128},
    "tiny-qwen3": {
        "kind": "decoder",
        "architecture": "Qwen3ForCausalLM",
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "intermediate": 128,
        "tie": True,
    },
}
MAX_SEQ_LENGTH = 512  # both embedders' sentence-transformers max_seq_length


def tokenizer_vocab() -> int:
    return len(json.loads((TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])


def build_decoder(path: Path, shape: str, dtype: str, device: str, seed: int = 0) -> Path:
    """A random causal LM of `shape` (DECODERS), saved in `dtype`; drawn on `device` (a GPU draws a
    billion parameters in a moment). The model's vocabulary may be larger than the tokenizer's:
    the benchmark's prompts are token ids."""
    import torch

    from tests.fixtures.tiny_decoder import random_causal_lm

    spec = dict(DECODERS[shape])
    arch, vocab, tie = spec.pop("architecture"), spec.pop("vocab"), spec.pop("tie")
    config = {
        "hidden_size": spec.pop("hidden"),
        "num_hidden_layers": spec.pop("layers"),
        "num_attention_heads": spec.pop("heads"),
        "num_key_value_heads": spec.pop("kv_heads"),
        "intermediate_size": spec.pop("intermediate"),
        "max_position_embeddings": spec.pop("max_positions"),
        **spec,
    }
    path.mkdir(parents=True, exist_ok=True)
    with torch.device(device):
        model = random_causal_lm(
            arch, vocab, seed, initializer_range=0.02, tie_word_embeddings=tie, bos_token_id=101,
            eos_token_id=102, pad_token_id=0, **config,
        ).to(getattr(torch, dtype))  # fmt: skip
    model.save_pretrained(path, safe_serialization=True)
    shutil.copy(TOKENIZER / "tokenizer.json", path / "tokenizer.json")
    return path


def build_embedder(path: Path, shape: str, dtype: str, device: str, seed: int = 0) -> Path:
    """A random sentence-transformers embedder of `shape` (EMBEDDERS): BERT with mean pooling, or a
    decoder with last-token pooling (as Qwen3-Embedding), both normalised."""
    from tests.fixtures.tiny import build_tiny_bert
    from tests.fixtures.tiny_decoder import add_sentence_transformers_files, build_tiny_decoder

    spec = dict(EMBEDDERS[shape])
    if spec.pop("kind") == "bert":
        # NOTE: scale 0.02 is BERT's initializer_range: activations in the range trained weights give
        return build_tiny_bert(
            path, **spec, max_positions=MAX_SEQ_LENGTH, max_seq_length=MAX_SEQ_LENGTH, seed=seed,
            tokenizer_dir=TOKENIZER, scale=0.02,
        )  # fmt: skip
    arch = spec.pop("architecture")
    built = build_tiny_decoder(
        path, arch, **spec, max_positions=MAX_SEQ_LENGTH, initializer_range=0.02, seed=seed,
        tokenizer_dir=TOKENIZER, dtype=dtype, init_device=device,
    )  # fmt: skip
    return add_sentence_transformers_files(built, "last", normalize=True, max_seq_length=MAX_SEQ_LENGTH)


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text(encoding="utf-8"))


def forward_flops(config: dict[str, Any], lengths: Sequence[int] | np.ndarray) -> float:
    """FLOPs of one forward over rows of these lengths (no padding: the useful work), without any
    LM head: 2 per multiply-add of every linear layer, and attention's QK^T and PV over each row's
    own tokens (half of them for a causal decoder)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    dim = config.get("head_dim") or h // heads
    if config.get("model_type") == "bert":
        per_token = 2 * (4 * h * h + 2 * h * inter)
        attention = 4 * heads * dim * float((lengths**2).sum())
    else:
        kv = config["num_key_value_heads"]
        per_token = 2 * (h * (heads + 2 * kv) * dim + heads * dim * h + 3 * h * inter)
        attention = 4 * heads * dim * float((lengths * (lengths + 1) / 2).sum())
    return layers * (per_token * float(lengths.sum()) + attention)


def kv_bytes_per_token(config: dict[str, Any], element_size: int) -> int:
    """K and V of one token over every layer."""
    heads = config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * dim * element_size


def decode_step_bytes(weight_bytes: int, kv_token_bytes: int, contexts: Sequence[int]) -> int:
    """Bytes one decode step must read: every weight once (the LM head's included; an input
    embedding reads one row per sequence, nothing), and each sequence's cached K/V."""
    return weight_bytes + kv_token_bytes * int(sum(contexts))


def main(argv: list[str] | None = None) -> int:
    """python benchmarks/gpu_check/gpu_models.py OUT_DIR SHAPE... [--device cuda] [--dtype bfloat16]:
    OUT_DIR/SHAPE each."""
    import argparse
    import sys
    import time

    sys.path.insert(0, str(REPO))  # NOTE: runs from a checkout, installed or not
    from tests.fixtures.tiny import build_minilm_shaped

    p = argparse.ArgumentParser(description="Writes random checkpoints of the GPU check's shapes.")
    p.add_argument("out", type=Path)
    p.add_argument("shapes", nargs="+", choices=("minilm", *DECODERS, *EMBEDDERS))
    p.add_argument("--device", default="cpu", help="where a decoder's random weights are drawn")
    p.add_argument("--dtype", default="float32", help="a decoder's saved weights' dtype")
    args = p.parse_args(argv)
    for shape in args.shapes:
        t0, out = time.perf_counter(), args.out / shape
        if shape == "minilm":  # all-MiniLM-L6-v2's exact shape, for the checks and the multi-device step
            path = build_minilm_shaped(out, TOKENIZER)
        else:
            path = (build_decoder if shape in DECODERS else build_embedder)(out, shape, args.dtype, args.device)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"random {shape} checkpoint: {path} ({size / 2**20:,.0f} MiB, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
