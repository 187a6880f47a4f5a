"""Sequence classifiers (`--task classify`): a BERT-family encoder and its classification head.

Four heads, each read natively from a `*ForSequenceClassification` checkpoint:
- BERT's (also NomicBERT's): the pooler (dense + tanh on [CLS]), then `classifier`;
- RoBERTa's (also XLM-R's, CamemBERT's and MPNet's): `classifier.dense` + tanh +
  `classifier.out_proj` on <s>;
- DistilBERT's: `pre_classifier` + ReLU + `classifier`;
- ModernBERT's: [CLS] or the mean of the row's tokens, `head.dense` + GELU + `head.norm`, then
  `classifier`.
The encoder is the embedding path's (models/encoders.py, by model_type); the head turns the first token's state into
logits, and `postprocess` into probabilities: softmax over the labels, or a sigmoid per label for
`problem_type: multi_label_classification`. The writer takes the best label and its probability.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelError, UnsupportedModel
from .batch_model import BatchSteps
from .bert import BertEncoder
from .encoders import encoder_config

FAMILIES = {
    "bert": "BertForSequenceClassification",
    "roberta": "RobertaForSequenceClassification",
    "xlm-roberta": "XLMRobertaForSequenceClassification",
    "camembert": "CamembertForSequenceClassification",
    "distilbert": "DistilBertForSequenceClassification",
    "mpnet": "MPNetForSequenceClassification",
    "modernbert": "ModernBertForSequenceClassification",
    "nomic_bert": "NomicBertForSequenceClassification",
}
_HEAD_FAMILY = {"xlm-roberta": "roberta", "camembert": "roberta", "mpnet": "roberta"}  # the same head's names


@dataclass(frozen=True, slots=True)
class ClassifierSpec:
    """What the checkpoint's head is: its family, its labels (id2label order), multi-label or not;
    for `--task score` (a cross-encoder: one label), the activation of its one logit and the
    separator whose first occurrence starts a pair's second segment (BERT's token types)."""

    family: str
    labels: tuple[str, ...]
    multi_label: bool = False
    score: bool = False
    activation: str = "sigmoid"  # sigmoid | identity (a score's logit as it is)
    sep_id: int | None = None
    # ModernBERT's head: the rows' states pooled ('cls' or 'mean'), dense (with a bias or not), the
    # activation, then a LayerNorm (its eps, with a bias or not) before the labels' linear
    pooling: str = "cls"
    dense_bias: bool = True
    head_norm: tuple[float, bool] | None = None  # (eps, bias) of the norm after the activation


def classifier_config(raw: dict[str, Any], path: Path, score: bool = False) -> tuple[Any, ClassifierSpec]:
    """The encoder's config and the head's spec from a `*ForSequenceClassification` config.json;
    `score`: a cross-encoder's (one label), for `--task score`."""
    family = str(raw.get("model_type"))
    arch = next(iter(raw.get("architectures") or []), None)
    if not str(arch).endswith("ForSequenceClassification"):
        raise ModelError(f"not a sequence classifier: {arch!r} (a *ForSequenceClassification)", path=str(path))
    if family not in FAMILIES or arch != FAMILIES[family]:
        supported = ", ".join(FAMILIES.values())
        raise UnsupportedModel(
            f"no native sequence classifier for {arch!r} (native: {supported}; any other on --backend transformers)",
            path=str(path),
        )
    config = encoder_config(raw, path)
    spec = head_spec(raw, _HEAD_FAMILY.get(family, family), path, score)
    if family == "modernbert":
        pooling, activation = raw.get("classifier_pooling", "cls"), raw.get("classifier_activation", "gelu")
        if activation != "gelu" or pooling not in ("cls", "mean"):
            raise UnsupportedModel(
                f"a ModernBERT classifier head with {activation} over {pooling} pooling", path=str(path)
            )
        norm = (float(raw.get("norm_eps", 1e-5)), bool(raw.get("norm_bias", False)))
        bias = bool(raw.get("classifier_bias", False))
        spec = replace(spec, pooling=str(pooling), dense_bias=bias, head_norm=norm)
    return config, spec


def head_spec(raw: dict[str, Any], family: str, path: Path, score: bool) -> ClassifierSpec:
    """A classifier config.json's labels (id2label order) and problem type; with `score`, as a
    cross-encoder: one label, and sentence-transformers' CrossEncoder activation (a sigmoid over
    the logit unless the checkpoint names Identity)."""
    id2label = raw.get("id2label") or {"0": "LABEL_0"}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label)))
    if not score:
        return ClassifierSpec(family, labels, raw.get("problem_type") == "multi_label_classification")
    if len(labels) != 1:
        raise ModelError(
            f"a cross-encoder scores with one label; this classifier has {len(labels)} (use --task classify)",
            path=str(path),
        )
    named = str((raw.get("sentence_transformers") or {}).get("activation_fn") or "Sigmoid")
    if not named.endswith(("Sigmoid", "Identity")):
        raise ModelError(f"unsupported CrossEncoder activation_fn {named!r} (Sigmoid or Identity)", path=str(path))
    return ClassifierSpec(family, ("score",), False, True, "identity" if named.endswith("Identity") else "sigmoid")


def pair_separator(path: Path) -> int | None:
    """The id of the tokenizer's [SEP]: the token whose first occurrence starts a pair's second segment."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("[SEP]")


def pair_token_types(ids: torch.Tensor, sep_id: int) -> torch.Tensor:
    """BERT's token types of right-padded pairs, on the device: 1 after the first separator
    ("[CLS] a [SEP] b [SEP]" -> 0 0 0 1 1), as the tokenizer's pair template types them."""
    sep = (ids == sep_id).int()
    return ((sep.cumsum(dim=1) - sep) > 0).long()


def label_probabilities(logits: torch.Tensor, spec: ClassifierSpec) -> torch.Tensor:
    """A head's logits as the task reports them: a score (sigmoid or raw), each label's sigmoid
    (multi-label) or a softmax over the labels."""
    logits = logits.float()
    if spec.score:
        return torch.sigmoid(logits) if spec.activation == "sigmoid" else logits
    return torch.sigmoid(logits) if spec.multi_label else torch.softmax(logits, dim=-1)


class ClassificationHead(nn.Module):
    """The pooled state (the first token's, or ModernBERT's mean) -> logits, in the family's own layers."""

    def __init__(self, spec: ClassifierSpec, hidden: int) -> None:
        super().__init__()
        self.family = spec.family
        # BERT's pooler, RoBERTa's dense, DistilBERT's pre_classifier, ModernBERT's head.dense
        self.dense = nn.Linear(hidden, hidden, bias=spec.dense_bias)
        self.norm = nn.LayerNorm(hidden, eps=spec.head_norm[0], bias=spec.head_norm[1]) if spec.head_norm else None
        self.out = nn.Linear(hidden, len(spec.labels))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        h = self.dense(pooled)
        act = {"distilbert": torch.relu, "modernbert": nn.functional.gelu}.get(self.family, torch.tanh)
        h = act(h)
        return self.out(self.norm(h) if self.norm is not None else h)


_HEAD_NAMES = {
    "bert": {"bert.pooler.dense": "dense", "classifier": "out"},
    "roberta": {"classifier.dense": "dense", "classifier.out_proj": "out"},
    "distilbert": {"pre_classifier": "dense", "classifier": "out"},
    "modernbert": {"head.dense": "dense", "head.norm": "norm", "classifier": "out"},
    "nomic_bert": {"nomic_bert.pooler.dense": "dense", "classifier": "out"},  # BERT's head
}


def split_weights(
    weights: dict[str, torch.Tensor], spec: ClassifierSpec
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the encoder's weights as the checkpoint names them, the head's under ClassificationHead's)."""
    encoder: dict[str, torch.Tensor] = {}
    head: dict[str, torch.Tensor] = {}
    names = _HEAD_NAMES[spec.family]
    for name, tensor in weights.items():
        module, _, kind = name.rpartition(".")
        if module in names:
            head[f"{names[module]}.{kind}"] = tensor
            continue
        encoder[name] = tensor  # NOTE: the architecture's rename (models/encoders.py) maps these
    return encoder, head


class SequenceClassifier(BatchSteps):
    """Encoder + head; a `BatchModel` whose row vector is each label's probability."""

    def __init__(self, encoder: BertEncoder, head: ClassificationHead, spec: ClassifierSpec, dtype: torch.dtype):
        self.encoder, self.head, self.spec, self.dtype = encoder, head, spec, dtype
        self.output_dim = len(spec.labels)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        types = pair_token_types(ids, self.spec.sep_id) if self.spec.sep_id is not None else None
        hidden, token_mask = self.encoder(ids, lengths, padded, types)
        if self.spec.pooling == "mean":  # NOTE: ModernBERT's option: the mean of the row's real tokens
            mask = token_mask.unsqueeze(-1).to(hidden.dtype)
            return self.head((hidden * mask).sum(dim=1) / mask.sum(dim=1))
        return self.head(hidden[:, 0])

    def postprocess(self, outputs: object) -> torch.Tensor:
        return label_probabilities(outputs, self.spec)  # type: ignore[arg-type]


__all__ = [
    "FAMILIES",
    "ClassificationHead",
    "ClassifierSpec",
    "SequenceClassifier",
    "classifier_config",
    "split_weights",
]
