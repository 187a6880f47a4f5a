"""Builds tiny random Llama-family checkpoints with `transformers` (tests and benchmarks only).

The tokenizer is the packaged MiniLM `tokenizer.json` (a real WordPiece tokenizer), with a small
chat template in tokenizer_config.json so chat rendering can be checked against transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .registry import resolve_model_path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token if loop.first else '' }}[{{ message['role'] | upper }}] {{ message['content'] | trim }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
SEP_ID = 102  # MiniLM's [SEP]: the tiny checkpoints' EOS


def random_causal_lm(architecture: str, vocab_size: int, seed: int, **config: Any) -> Any:
    """`transformers`' own `architecture` with random weights drawn from `seed`, in eval mode."""
    import torch
    import transformers

    family = architecture.removesuffix("ForCausalLM")
    torch.manual_seed(seed)
    return getattr(transformers, architecture)(
        getattr(transformers, f"{family}Config")(vocab_size=vocab_size, **config)
    ).eval()


def build_tiny_decoder(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 512,
    initializer_range: float = 0.1,
    tie: bool = False,
    seed: int = 0,
    shards: bool = False,
    tokenizer_dir: str | Path | None = None,
    dtype: str = "float32",
    init_device: str = "cpu",
    **extra: Any,
) -> Path:
    """Writes a random checkpoint of `architecture` (transformers' own class) and returns its path.

    The tokenizer.json comes from `tokenizer_dir`, by default the packaged default model's (a
    machine without that package, such as a bare GPU machine, gives benchmarks/minilm_tokenizer).
    `dtype` is the saved weights' dtype; `init_device` where the random weights are drawn (a GPU
    draws a billion-parameter model in a moment, a CPU takes a while).
    """
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer_dir) if tokenizer_dir is not None else resolve_model_path("default")
    shutil.copy(source / "tokenizer.json", path / "tokenizer.json")
    vocab = len(json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    shape = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads}
    shape |= {
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
    }
    with torch.device(init_device):
        model = random_causal_lm(
            architecture, vocab, seed, initializer_range=initializer_range, tie_word_embeddings=tie,
            bos_token_id=101, eos_token_id=SEP_ID, pad_token_id=0, **shape, **extra,
        ).to(getattr(torch, dtype))  # fmt: skip
    model.save_pretrained(path, max_shard_size="200KB" if shards else "2GB", safe_serialization=True)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[CLS]",
        "eos_token": "[SEP]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1), encoding="utf-8")
    return path


def add_sentence_transformers_files(
    path: str | Path, pooling: str = "last", normalize: bool = True, max_seq_length: int = 128
) -> Path:
    """Makes a decoder checkpoint a sentence-transformers embedder, as Qwen3-Embedding's files do."""
    from .tiny import write_sentence_transformers_files

    path = Path(path)
    hidden = json.loads((path / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    write_sentence_transformers_files(path, hidden, pooling, normalize, max_seq_length)
    return path
