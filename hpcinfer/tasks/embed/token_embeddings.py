"""`--task embed --output-value token_embeddings`: one vector per token (late interaction, ColBERT
style), as sentence-transformers' `encode(texts, output_value="token_embeddings")` gives them: the
BERT encoder's last hidden states for the row's real tokens, special tokens included, padding not.

A row's values are ragged items (`values.Ragged`): one `token_embeddings` item (a float32 vector
of the hidden size) per real token, nothing for padding. The store writes them as they come: a
Parquet `list<fixed_size_list<float32, dim>>` column, JSONL lists of lists.

sentence-transformers takes `token_embeddings` from the Transformer module's output: a Pooling,
Dense or Normalize module writes `sentence_embedding` (their default `module_input_name`) and leaves
the token states as they are, so a checkpoint with them is read as its encoder alone; one whose
Dense or Normalize acts on `token_embeddings` would change them and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from ...config import RunConfig
from ...errors import ConfigError, ModelError, UnsupportedModel
from ...files.part_format import id_array
from ...files.parts import TableStore
from ...files.sources import is_openai_input
from ...models.batch_model import BatchSteps
from ...models.bert import can_pack_for_cpu, pack_for_cpu
from ...models.checkpoint import DECODER_TYPES, CheckpointInfo, PoolingSpec, load_encoder, model_dir_config
from ...models.encoders import encoder_config
from ...models.registry import resolve_model_path
from ...models.st_files import check_transformer_output, read_model_json, truncation_length
from ...pipeline.task import window_cut
from ...values import Ragged, RaggedField, RaggedSpec

TOKEN_STATES = "token_embeddings"  # sentence-transformers' name for the Transformer module's token states
# The module classes that leave the token states as the Transformer gave them (unless aimed at them)
_KEPT = ("Transformer", "Pooling", "Dense", "Normalize", "Dropout")


@dataclass(frozen=True, slots=True)
class TokenEmbeddingHead:
    """CheckpointInfo.head for token embeddings: the longest row and the states' width."""

    max_length: int
    dim: int

    def width(self, info: CheckpointInfo) -> int:
        return 0  # no dense values: a row's are its tokens' states (ragged)

    @property
    def ragged(self) -> RaggedSpec:
        return RaggedSpec((RaggedField(TOKEN_STATES, "float32", (self.dim,)),), self.max_length)

    def load(
        self, info: CheckpointInfo, device: torch.device, dtype: torch.dtype, cpu_fast_path: bool
    ) -> TokenEmbedder:
        encoder = load_encoder(info).to(device=device, dtype=dtype)
        if cpu_fast_path and can_pack_for_cpu(encoder):
            encoder = pack_for_cpu(encoder)
        return TokenEmbedder(encoder, self.max_length, self.dim)


class TokenEmbedder(BatchSteps):
    """The encoder as SentenceEmbedder runs it, its real tokens' states given as ragged items instead of pooled."""

    output_dim = 0

    def __init__(self, encoder: Any, max_length: int, dim: int) -> None:
        self.encoder, self.max_length, self.dim = encoder, max_length, dim

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, padded: bool) -> object:
        return self.encoder(ids, lengths, padded)

    def postprocess(self, outputs: object) -> Ragged:
        hidden, token_mask = outputs  # type: ignore[misc]
        # NOTE: row after row, each row's tokens in order (a boolean mask selects row-major)
        return Ragged(token_mask.sum(dim=1), {TOKEN_STATES: hidden[token_mask].float()})


def inspect_token_embedder(path: Path, max_length: int | None) -> CheckpointInfo:
    """A BERT checkpoint's facts for token embeddings; `max_length`: --max-length, if given."""
    raw = model_dir_config(path)
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind in DECODER_TYPES:
        raise ConfigError(
            f"--output-value token_embeddings runs hpcinfer's BERT encoders; a decoder embedder ({kind}) "
            "gives sentence embeddings only"
        )
    try:
        config = encoder_config(raw, path)  # NOTE: any native encoder (models/encoders.py)
    except UnsupportedModel as exc:  # NOTE: no transformers path to point at: token embeddings are native only
        native = exc.reason.split(";")[0] + ")"  # NOTE: the native list, without the fallback's hint
        raise UnsupportedModel(f"--output-value token_embeddings: {native}", path=str(path)) from None
    _check_modules(path)
    prompts: dict[str, str] = {}
    prompt = ""
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():  # NOTE: as sentence_transformers_info reads them: the prompt's tokens are embedded too
        raw_st = read_model_json(st_config)
        if isinstance(raw_st, dict):
            prompts = {str(k): str(v) for k, v in (raw_st.get("prompts") or {}).items()}
            prompt = prompts.get(str(raw_st.get("default_prompt_name")), "")
    positions = config.max_position_embeddings
    longest = min(truncation_length(path, positions), positions - config.position_offset)  # RoBERTa's offset
    head = TokenEmbeddingHead(max_length or longest, config.hidden_size)
    return CheckpointInfo(path, config, PoolingSpec(), longest, prompts, prompt, head=head)


def _check_modules(path: Path) -> None:
    """modules.json may name only modules that leave the token states alone (see the module)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return
    modules = read_model_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelError("modules.json is not a list of modules", path=str(modules_file))
    for module in modules:
        kind = str(module.get("type", ""))
        name = kind.rsplit(".", 1)[-1]
        folder = str(module.get("path", ""))
        if not kind.startswith("sentence_transformers.") or name not in _KEPT:
            raise ModelError(
                f"module {kind!r} is not supported with --output-value token_embeddings (hpcinfer reads "
                f"{', '.join(_KEPT)})",
                path=str(modules_file),
            )
        if name == "Transformer" and folder not in ("", "."):
            raise ModelError(f"the Transformer module is in a subfolder ({folder!r})", path=str(modules_file))
        if name in ("Dense", "Normalize"):
            cfg_file = path / folder / "config.json"
            cfg = read_model_json(cfg_file) if folder not in ("", ".") and cfg_file.is_file() else {}
            cfg = cfg if isinstance(cfg, dict) else {}
            target = cfg.get("module_input_name", "sentence_embedding")
            if TOKEN_STATES in (target, cfg.get("module_output_name") or target):
                raise ModelError(
                    f"the {name} module acts on the token embeddings, which hpcinfer does not compute",
                    path=str(cfg_file),
                )
    check_transformer_output(path)  # NOTE: the token states must be the last hidden states over the text


def settle_token_embeddings(config: RunConfig) -> RunConfig:
    """The options token embeddings cannot take, refused in one line; the default window cut to what
    its rows' states may hold (pipeline/task.py's `window_cut`)."""
    embed = config.embed
    refused = [
        (embed.precision != "float32", f"--precision {embed.precision} quantizes sentence embeddings"),
        (embed.dimensions is not None, "--dimensions truncates the sentence embedding (Matryoshka)"),
        (embed.pooling is not None, "--pooling makes the sentence embedding of the token states"),
        (embed.normalize is not None, "--normalize/--no-normalize apply to the sentence embedding"),
        (config.backend == "transformers", "--backend transformers: token embeddings run hpcinfer's own BERT encoder"),
        (config.device.quantize != "none", f"--quantize {config.device.quantize}: token embeddings run float weights"),
        (config.device.tensor_parallel > 1, "--tp splits a decoder; token embeddings run an encoder"),
    ]
    for hit, why in refused:
        if hit:
            raise ConfigError(f"--output-value token_embeddings: {why}; drop it")
    if is_openai_input(config.input):
        raise ConfigError("--output-value token_embeddings: an OpenAI batch file has no token-embedding endpoint")
    return window_cut(config, inspect_token_embedder(resolve_model_path(config.model), config.tokenize.max_length))


class TokenEmbeddingStore(TableStore):
    """Parts of token-embedding rows: each row's tokens' states, as the head gave them."""

    def __init__(self, output: str, fmt: str, info: CheckpointInfo, fp: dict[str, Any]) -> None:
        super().__init__(output, fmt, info.output_dim, fp)
        self.ragged = info.ragged

    def table(self, ids: list[Any], values: Ragged) -> pa.Table:
        return pa.table({"id": id_array(ids), TOKEN_STATES: values.columns()[TOKEN_STATES]})


__all__ = ["TokenEmbeddingHead", "TokenEmbeddingStore", "inspect_token_embedder", "settle_token_embeddings"]
