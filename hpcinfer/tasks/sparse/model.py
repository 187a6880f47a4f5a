"""A SPLADE checkpoint as the encoder pipeline runs it: the BERT (or RoBERTa / XLM-R / CamemBERT)
encoder, its masked-LM head (transformers' `BertLMPredictionHead`, RoBERTa's `lm_head`), then
SPLADE pooling as sentence-transformers' `SpladePooling` computes it: log(1 + relu(logits)) (twice
log1p for `log1p_relu`) over the row's tokens, padding as zeros, then the max (or sum) over tokens.

A row's values are ragged items (`values.Ragged`): its non-zero vocabulary entries, `index`
ascending and `value`, picked on the device (the `max_active_dims` largest first, where set), so
no vocabulary-wide row leaves the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ModelError
from ...models.batch_model import BatchSteps
from ...models.bert import ACTIVATIONS, BertConfig, BertEncoder, can_pack_for_cpu, pack_for_cpu
from ...models.checkpoint import CheckpointInfo, encoder_from_weights, load_weights, weights_file
from ...models.meta import empty_modules
from ...values import Ragged, RaggedField, RaggedSpec

# NOTE: the logits of a batch are rows x tokens x vocabulary: pooled a slice of tokens at a time so
# a token-budget batch never holds them all (~2 GiB for 16k tokens over BERT's 30522 words)
LOGITS_BUDGET = 1 << 22  # float elements of logits alive at once (16 MiB in float32: SPLADE peaks near dense)


@dataclass(frozen=True, slots=True)
class SpladeHead:
    """What the checkpoint's head is (CheckpointInfo.head): its vocabulary, its SpladePooling
    settings, the checkpoint's `max_active_dims` (its top-k), whether the decoder is the word embeddings."""

    vocab_size: int
    strategy: str = "max"  # max | sum
    activation: str = "relu"  # relu | log1p_relu
    top_k: int | None = None
    tied: bool = True

    def width(self, info: CheckpointInfo) -> int:
        return 0  # no dense values: a row's are its non-zero vocabulary entries (ragged)

    @property
    def ragged(self) -> RaggedSpec:
        fields = (RaggedField("index", "int32"), RaggedField("value", "float32"))
        return RaggedSpec(fields, min(self.top_k or self.vocab_size, self.vocab_size))

    def load(self, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool) -> SpladeModel:
        encoder, mlm = load_splade(info, self)
        encoder = encoder.to(device=device, dtype=dtype)
        if cpu_fast_path and can_pack_for_cpu(encoder):
            encoder = pack_for_cpu(encoder)
        mlm = mlm.to(device=device, dtype=dtype)
        if self.tied:  # NOTE: one vocabulary x hidden matrix (47 MB for BERT's) on the device too, as tied
            mlm.decoder.weight = encoder.word_embeddings.weight
        return SpladeModel(encoder, mlm, self)


class MLMHead(nn.Module):
    """transformers' BertLMPredictionHead (RoBERTa's lm_head is the same with GELU): dense, the
    activation, LayerNorm, then the decoder (tied to the word embeddings unless the checkpoint says
    otherwise) plus its bias."""

    def __init__(self, cfg: BertConfig, activation: str) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = ACTIVATIONS[activation]
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(hidden))))


def load_splade(info: CheckpointInfo, head: SpladeHead) -> tuple[BertEncoder, MLMHead]:
    """The encoder and the masked-LM head (float32, CPU); strict about missing tensors."""
    file = weights_file(info.path)
    if file is None:
        raise ModelError("no model.safetensors or pytorch_model.bin", path=str(info.path))
    weights = load_weights(file)
    bert = info.config.model_type == "bert"
    activation = info.config.hidden_act if bert else "gelu"  # NOTE: RoBERTa's lm_head is GELU whatever the config
    if activation not in ACTIVATIONS:
        raise ModelError(f"unsupported hidden_act {activation!r}", path=str(info.path))

    def named(*names: str) -> torch.Tensor | None:
        return next((weights[n] for n in names if n in weights), None)

    words = named(
        f"{'bert' if bert else 'roberta'}.embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"
    )
    p, dense, norm = (
        ("cls.predictions.", "transform.dense.", "transform.LayerNorm.")
        if bert
        else ("lm_head.", "dense.", "layer_norm.")
    )
    found = {
        "dense.weight": named(p + dense + "weight"),
        "dense.bias": named(p + dense + "bias"),
        "norm.weight": named(p + norm + "weight", p + norm + "gamma"),
        "norm.bias": named(p + norm + "bias", p + norm + "beta"),
        # NOTE: transformers saves a tied decoder as the word embeddings alone, and its bias as
        # `cls.predictions.bias` / `lm_head.bias` (decoder.bias is tied to it)
        "decoder.weight": words if head.tied else named(p + "decoder.weight"),  # NOTE: tied: shared after the load
        "decoder.bias": named(p + "decoder.bias", p + "bias"),
    }
    missing = sorted(k for k, v in found.items() if v is None)
    if missing:
        raise ModelError(f"the masked-LM head's weights are missing {missing}", path=str(file))
    with empty_modules():  # NOTE: the head takes the checkpoint's tensors as they are: no second copy
        mlm = MLMHead(info.config, activation)
    mlm.load_state_dict({k: v.float() for k, v in found.items()}, assign=True)  # type: ignore[union-attr]
    return encoder_from_weights(info.config, weights, file), mlm.eval().requires_grad_(False)


class SpladeModel(BatchSteps):
    """Encoder + masked-LM head + SPLADE pooling; a `BatchModel` whose rows are their non-zero entries."""

    output_dim = 0

    def __init__(self, encoder: BertEncoder, mlm: MLMHead, head: SpladeHead) -> None:
        self.encoder, self.mlm, self.head = encoder, mlm, head
        self.vocab = head.vocab_size

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        return self.encoder(ids, lengths, padded)

    def postprocess(self, outputs: object) -> Ragged:
        hidden, token_mask = outputs  # type: ignore[misc]
        step = max(1, LOGITS_BUDGET // max(1, token_mask.shape[0] * self.vocab))
        pool = self._max_pool if self.head.strategy == "max" else self._pool_each_token
        pooled = pool(hidden, token_mask, step)  # [rows, vocab]: the head's own, never handed on
        if self.head.top_k is not None and self.head.top_k < self.vocab:
            # NOTE: as SparseEncoder's max_active_dims: the k largest (absolute) values kept, in
            # vocabulary order; one of them that is 0 is no entry
            _, index = torch.topk(pooled.abs(), self.head.top_k, dim=-1)
            index = index.sort(dim=-1).values
            value = pooled.gather(-1, index)
        else:
            index = torch.arange(self.vocab, device=pooled.device).expand_as(pooled)
            value = pooled
        kept = value != 0
        return Ragged(kept.sum(dim=1), {"index": index[kept].int(), "value": value[kept].float()})

    def _max_pool(self, hidden: torch.Tensor, token_mask: torch.Tensor, step: int) -> torch.Tensor:
        """Max pooling with the activation taken once per row, not once per token: log1p and relu
        never decrease, so the max of log1p(relu(logit)) over tokens is log1p(relu(the max logit)),
        the same float. Padding's logits are -inf, so they never win the max (SpladePooling's zeros
        for padding are relu's floor); one pass over the logits besides the matmul that makes them."""
        pooled = torch.full((hidden.shape[0], self.vocab), -torch.inf, device=hidden.device)
        for start in range(0, hidden.shape[1], step):
            logits = self.mlm(hidden[:, start : start + step]).float()
            logits.masked_fill_(~token_mask[:, start : start + step, None], -torch.inf)
            pooled = torch.maximum(pooled, logits.amax(dim=1))
        weights = pooled.relu_().log1p_()
        return weights.log1p_() if self.head.activation == "log1p_relu" else weights

    def _pool_each_token(self, hidden: torch.Tensor, token_mask: torch.Tensor, step: int) -> torch.Tensor:
        rows, n = token_mask.shape
        pooled = torch.zeros(rows, self.vocab, device=hidden.device)
        for start in range(0, n, step):
            logits = self.mlm(hidden[:, start : start + step]).float()
            # NOTE: as SpladePooling: padding's logits become 0 before relu and log1p, so they pool as 0
            weights = logits.masked_fill_(~token_mask[:, start : start + step, None], 0.0).relu_().log1p_()
            if self.head.activation == "log1p_relu":
                weights = weights.log1p_()
            pooled += weights.sum(dim=1)
        return pooled
