"""Builds a random BERT checkpoint in Hugging Face format (config.json, model.safetensors,
tokenizer.json, sentence-transformers pooling config): tiny ones for tests and I/O-bound
benchmarks, and one of all-MiniLM-L6-v2's exact shape (same speed as the real weights) where the
packaged model is not installed, such as a bare GPU machine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .registry import resolve_model_path


def build_tiny_bert(
    path: str | Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 64,
    max_positions: int = 512,
    max_seq_length: int = 256,
    pooling: str = "mean",
    normalize: bool = True,
    seed: int = 0,
    prefix: str = "",
    tokenizer_dir: str | Path | None = None,
    scale: float = 0.2,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> Path:
    """Writes the checkpoint and returns its directory.

    The tokenizer (tokenizer.json, and its tokenizer_config.json and special_tokens_map.json where
    present) comes from `tokenizer_dir`, by default the packaged default model's. Weights are
    normal with standard deviation `scale`.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer_dir) if tokenizer_dir is not None else resolve_model_path("default")
    tokenizer = source / "tokenizer.json"
    vocab = len(json.loads(tokenizer.read_text(encoding="utf-8"))["model"]["vocab"])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_positions,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
        "pad_token_id": 0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w: dict[str, torch.Tensor] = {
        "embeddings.word_embeddings.weight": rand(vocab, hidden),
        "embeddings.position_embeddings.weight": rand(max_positions, hidden),
        "embeddings.token_type_embeddings.weight": rand(2, hidden),
        "embeddings.LayerNorm.weight": 1 + rand(hidden),
        "embeddings.LayerNorm.bias": rand(hidden),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name, (out_f, in_f) in {
            "attention.self.query": (hidden, hidden),
            "attention.self.key": (hidden, hidden),
            "attention.self.value": (hidden, hidden),
            "attention.output.dense": (hidden, hidden),
            "intermediate.dense": (intermediate, hidden),
            "output.dense": (hidden, intermediate),
        }.items():
            w[p + name + ".weight"], w[p + name + ".bias"] = rand(out_f, in_f), rand(out_f)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + norm + ".weight"], w[p + norm + ".bias"] = 1 + rand(hidden), rand(hidden)
    save_file({prefix + k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    write_sentence_transformers_files(path, hidden, pooling, normalize, max_seq_length, prompts, default_prompt_name)
    return path


def write_sentence_transformers_files(
    path: Path,
    hidden: int,
    pooling: str,
    normalize: bool,
    max_seq_length: int,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> None:
    """modules.json (Transformer, Pooling, and Normalize when asked), the pooling config,
    sentence_bert_config.json and, with `prompts`, config_sentence_transformers.json."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2), encoding="utf-8")
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {
        "cls_token": pooling == "cls",
        "mean_tokens": pooling == "mean",
        "max_tokens": pooling == "max",
        "mean_sqrt_len_tokens": pooling == "mean_sqrt_len",
        "lasttoken": pooling == "last",
    }
    pool_cfg = {"word_embedding_dimension": hidden, **{f"pooling_mode_{k}": v for k, v in modes.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg, indent=2), encoding="utf-8")
    st_cfg = {"max_seq_length": max_seq_length, "do_lower_case": False}
    (path / "sentence_bert_config.json").write_text(json.dumps(st_cfg), encoding="utf-8")
    if prompts:
        named = {"prompts": prompts, "default_prompt_name": default_prompt_name, "similarity_fn_name": "cosine"}
        (path / "config_sentence_transformers.json").write_text(json.dumps(named), encoding="utf-8")


# all-MiniLM-L6-v2's shape (its config.json and sentence_bert_config.json)
MINILM_L6_SHAPE = {
    "hidden": 384,
    "layers": 6,
    "heads": 12,
    "intermediate": 1536,
    "max_positions": 512,
    "max_seq_length": 256,
}


def build_minilm_shaped(path: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    """A random checkpoint of all-MiniLM-L6-v2's exact shape, pooling and tokenizer.

    NOTE: scale 0.02 is BERT's initializer_range: activations stay in the range trained weights
    give, so half-precision error is representative too.
    """
    return build_tiny_bert(path, **MINILM_L6_SHAPE, seed=seed, tokenizer_dir=tokenizer_dir, scale=0.02)
