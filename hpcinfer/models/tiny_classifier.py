"""Builds tiny random `*ForSequenceClassification` checkpoints with `transformers` (tests and
benchmarks only): BERT, RoBERTa, XLM-R or DistilBERT, with the packaged MiniLM tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .registry import resolve_model_path

CONFIGS = {  # family -> (transformers class prefix, config fields of its shape)
    "bert": ("Bert", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}),
    "roberta": ("Roberta", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "intermediate_size": 128, "max_position_embeddings": 514, "pad_token_id": 1,
                            "type_vocab_size": 1}),
    "xlm-roberta": ("XLMRoberta", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "intermediate_size": 128, "max_position_embeddings": 514, "pad_token_id": 1,
                                   "type_vocab_size": 1}),
    "distilbert": ("DistilBert", {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128}),
}  # fmt: skip


def build_tiny_classifier(
    path: str | Path,
    family: str = "bert",
    labels: tuple[str, ...] = ("negative", "neutral", "positive"),
    multi_label: bool = False,
    seed: int = 0,
    **shape: Any,
) -> Path:
    """Writes a random classifier of `family` (transformers' own class) and returns its directory."""
    import torch
    import transformers

    prefix, fields = CONFIGS[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = resolve_model_path("default")
    shutil.copy(source / "tokenizer.json", path / "tokenizer.json")
    vocab = len(json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        problem_type="multi_label_classification"
        if multi_label
        else "regression"
        if len(labels) == 1
        else "single_label_classification",  # one label: a cross-encoder
        **{**fields, **shape},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForSequenceClassification")(config).eval()
    with torch.no_grad():  # NOTE: a wider head than the default init, so the labels differ across rows
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "model_max_length": 512,
    }
    if family == "bert":  # NOTE: as BERT's own tokenizer does: a pair's second segment has token type 1
        tokenizer_config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return path
