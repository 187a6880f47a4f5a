"""A SPLADE checkpoint's facts, read from its sentence-transformers files as `SparseEncoder` reads
them: a masked-LM Transformer module (6.x `MLMTransformer`, or `Transformer` with
`transformer_task: fill-mask`) over a BERT `*ForMaskedLM`, then a `SpladePooling` module.

NOTE: the files are parsed as data; nothing a module type names is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import ModelError, UnsupportedModel
from ...models.checkpoint import CheckpointInfo, PoolingSpec, model_dir_config
from ...models.encoders import encoder_config
from ...models.st_files import read_model_json, transformer_config, truncation_length
from .model import SpladeHead

STRATEGIES = ("max", "sum")  # SpladePooling.SPLADE_POOLING_MODES
ACTIVATIONS = ("relu", "log1p_relu")  # SpladePooling.SPLADE_ACTIVATION


def module_kinds(path: Path) -> list[tuple[str, str]]:
    """(class name, folder) of each module modules.json lists; [] where it has none or is not a list."""
    file = path / "modules.json"
    if not path.is_dir() or not file.is_file():
        return []
    try:
        modules = read_model_json(file)
    except ModelError:
        return []
    if not isinstance(modules, list):
        return []
    return [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules if isinstance(m, dict)]


def is_splade(path: Path) -> bool:
    """Whether the checkpoint's modules are a masked-LM Transformer and a SpladePooling (what `--task
    auto` looks for; the modules' settings are checked when the run inspects it)."""
    names = [name for name, _ in module_kinds(path)]
    transformer = "MLMTransformer" in names or ("Transformer" in names and _fill_mask(path, "feature-extraction"))
    return transformer and "SpladePooling" in names


def _fill_mask(path: Path, default_task: str) -> bool:
    try:
        return transformer_config(path).get("transformer_task", default_task) == "fill-mask"
    except ModelError:
        return False


# model_type -> the masked-LM architectures a SPLADE model of it is (its head: model.MLM_NAMES)
MASKED_LMS = {
    "bert": ("BertForMaskedLM", "BertForPreTraining"),
    "roberta": ("RobertaForMaskedLM",),
    "xlm-roberta": ("XLMRobertaForMaskedLM",),
    "camembert": ("CamembertForMaskedLM",),
}


def inspect_splade(path: Path) -> CheckpointInfo:
    """A BERT or RoBERTa / XLM-R / CamemBERT `*ForMaskedLM` under MLMTransformer + SpladePooling."""
    raw = model_dir_config(path)
    if not isinstance(raw, dict):
        raise ModelError("config.json is not an object", path=str(path))
    arch = next(iter(raw.get("architectures") or []), None)
    kind = str(raw.get("model_type"))
    if kind not in MASKED_LMS or arch not in (None, *MASKED_LMS[kind]):
        named = ", ".join(a for archs in MASKED_LMS.values() for a in archs[:1])
        raise UnsupportedModel(f"no native SPLADE model for {kind!r}, {arch!r} (native: {named})", path=str(path))
    config = encoder_config(raw, path)
    pooling = _splade_pooling(path)
    positions = config.max_position_embeddings
    longest = min(truncation_length(path, positions), positions - config.position_offset)  # RoBERTa's offset
    prompts, prompt, top_k = _model_config(path)
    head = SpladeHead(
        vocab_size=config.vocab_size,
        strategy=pooling["pooling_strategy"],
        activation=pooling["activation_function"],
        top_k=top_k,
        tied=bool(raw.get("tie_word_embeddings", True)),
    )
    # NOTE: the pooling spec is unused (the head pools); "max" keeps it one of the modes the options accept
    return CheckpointInfo(path, config, PoolingSpec("max"), longest, prompts, prompt, head=head)


def _splade_pooling(path: Path) -> dict[str, Any]:
    """The SpladePooling config, after checking every module is one hpcinfer computes for SPLADE."""
    modules_file = path / "modules.json"
    kinds = module_kinds(path)
    names = [name for name, _ in kinds]
    if sorted(names) not in (["MLMTransformer", "SpladePooling"], ["SpladePooling", "Transformer"]):
        raise ModelError(
            f"modules {names} are not a SPLADE model hpcinfer computes (an MLMTransformer and a SpladePooling)",
            path=str(modules_file),
        )
    transformer = "MLMTransformer" if "MLMTransformer" in names else "Transformer"
    folder = dict(kinds)[transformer]
    if folder not in ("", "."):
        raise ModelError(f"the {transformer} module is in a subfolder ({folder!r})", path=str(modules_file))
    cfg = transformer_config(path)
    task = cfg.get("transformer_task", "fill-mask" if transformer == "MLMTransformer" else "feature-extraction")
    modalities = cfg.get("modality_config") or {}
    text = modalities.get("text") or {}
    output = (text.get("method", "forward"), text.get("method_output_name", "logits"))
    if task != "fill-mask" or output != ("forward", "logits") or "message" in modalities:
        raise ModelError(
            f"the {transformer} module's output ({task}: {output[0]} -> {output[1]}) is not the masked-LM "
            "logits of plain texts that SPLADE pools",
            path=str(path),
        )
    pool_file = path / dict(kinds)["SpladePooling"] / "config.json"
    cfg = read_model_json(pool_file) if pool_file.is_file() else {}
    if not isinstance(cfg, dict):
        raise ModelError("the SpladePooling config is not a JSON object", path=str(pool_file))
    # NOTE: defaults as SpladePooling's; embedding_dimension (word_embedding_dimension before 6.x) only
    # reports the width, and chunk_size only bounds its memory: neither changes a value
    found = {"pooling_strategy": cfg.get("pooling_strategy", "max"),
             "activation_function": cfg.get("activation_function", "relu")}  # fmt: skip
    for key, allowed in (("pooling_strategy", STRATEGIES), ("activation_function", ACTIVATIONS)):
        if found[key] not in allowed:
            raise ModelError(f"SpladePooling {key} must be one of {', '.join(allowed)} (got {found[key]!r})",
                             path=str(pool_file))  # fmt: skip
    return found


def _model_config(path: Path) -> tuple[dict[str, str], str, int | None]:
    """config_sentence_transformers.json: (its prompts, the default prompt, `max_active_dims`)."""
    file = path / "config_sentence_transformers.json"
    raw = read_model_json(file) if file.is_file() else {}
    if not isinstance(raw, dict):
        return {}, "", None
    prompts = {str(k): str(v) for k, v in (raw.get("prompts") or {}).items()}
    prompt = prompts.get(str(raw.get("default_prompt_name")), "")  # as SparseEncoder.encode applies it
    top_k = raw.get("max_active_dims")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ModelError(f"max_active_dims must be a positive integer, got {top_k!r}", path=str(file))
    return prompts, prompt, top_k
