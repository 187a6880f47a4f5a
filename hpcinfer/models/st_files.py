"""A checkpoint's sentence-transformers files, read as sentence-transformers reads them, whichever
version (2.x to 6.x) wrote them: the truncation length, the modules (pooling, normalisation), lowercasing.

Where each version keeps them:
- the length: 2.x-5.x write `max_seq_length` to sentence_bert_config.json; 6.x writes no such key
  and keeps the limit as the tokenizer's `model_max_length` in tokenizer_config.json.
- the pooling: 2.x-5.x write one boolean flag per mode (`pooling_mode_mean_tokens`, ...); 6.x one
  `pooling_mode` string (or a list, to concatenate several).
- the module types: `sentence_transformers.models.Pooling` before 6.x,
  `sentence_transformers.sentence_transformer.modules.pooling.Pooling` and
  `sentence_transformers.base.modules.normalize.Normalize` (and the like) from 6.x.

A module or setting hpcinfer does not compute (a Dense projection, `weightedmean` pooling, pooling
that leaves the prompt out) is a one-line ModelError: never an embedding computed without it.
NOTE: the files are parsed as data; nothing a module type names is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import POOLING_MODES  # hpcinfer's (adapter.pool); --pooling's choices
from ..errors import ModelError

# The Transformer module's config, by the names versions have given it (sentence-transformers
# reads the first that exists).
TRANSFORMER_CONFIGS = tuple(
    f"sentence_{name}_config.json"
    for name in ("bert", "roberta", "distilbert", "camembert", "albert", "xlm-roberta", "xlnet")
)
UNSET_LENGTH = 10**12  # NOTE: transformers writes int(1e30) for "no limit"; no model has a trillion positions

# sentence-transformers' pooling mode names (6.x strings, and the 2.x-5.x flags that stand for
# them, in the order sentence-transformers concatenates them) -> hpcinfer's
_MODE_NAMES = {"cls": "cls", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean_sqrt_len", "lasttoken": "last"}
_FLAGS = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_lasttoken", "lasttoken"),
)
_COMPUTED = ("Transformer", "Pooling", "Normalize", "Dropout")  # the module classes hpcinfer computes


def read_model_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read model file ({exc})", path=str(path)) from None


def transformer_config(path: Path) -> dict:
    """The Transformer module's config (sentence_bert_config.json or an older name); {} where none."""
    for name in TRANSFORMER_CONFIGS:
        if (path / name).is_file():
            raw = read_model_json(path / name)
            if not isinstance(raw, dict):
                raise ModelError("not a JSON object", path=str(path / name))
            if raw:
                return raw
    return {}


def _length(value: Any, where: str, path: Path) -> int | None:
    """A length setting as an int; None where it is unset (null, or transformers' huge sentinel)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ModelError(f"{where} must be a positive integer, got {value!r}", path=str(path))
    if value >= UNSET_LENGTH:
        return None
    if value != int(value):
        raise ModelError(f"{where} must be a positive integer, got {value!r}", path=str(path))
    return int(value)


def truncation_length(path: Path, positions: int) -> int:
    """The length sentence-transformers truncates every text to, never above the model's `positions`.

    As sentence-transformers 6.x loads any version's files: a `model_max_length` the Transformer
    config passes its tokenizer (`tokenizer_args`, 6.x `processor_kwargs`), else its
    `max_seq_length` (2.x-5.x), else the tokenizer's `model_max_length` (tokenizer_config.json, as
    6.x saves the limit); a `max_length` in 6.x `processing_kwargs` (text, else common) wins over all.
    """
    cfg = transformer_config(path)
    where = next((n for n in TRANSFORMER_CONFIGS if (path / n).is_file()), TRANSFORMER_CONFIGS[0])
    found: int | None = None
    for key in ("text", "common"):
        section = (cfg.get("processing_kwargs") or {}).get(key) or {}
        if found is None and isinstance(section, dict):
            found = _length(section.get("max_length"), f"processing_kwargs.{key}.max_length", path / where)
    for key in ("processor_kwargs", "tokenizer_args"):
        args = cfg.get(key) or {}
        if found is None and isinstance(args, dict):
            found = _length(args.get("model_max_length"), f"{key}.model_max_length", path / where)
    if found is None:
        found = _length(cfg.get("max_seq_length"), "max_seq_length", path / where)
    tokenizer_config = path / "tokenizer_config.json"
    if found is None and tokenizer_config.is_file():
        raw = read_model_json(tokenizer_config)
        if isinstance(raw, dict):
            found = _length(raw.get("model_max_length"), "model_max_length", tokenizer_config)
    return min(positions, found or positions)


def lowercases(path: Path) -> bool:
    """Whether sentence-transformers lowercases texts before its tokenizer (2.x-5.x `do_lower_case`)."""
    return path.is_dir() and bool(transformer_config(path).get("do_lower_case"))


def modules_pooling(path: Path) -> tuple[str | None, bool]:
    """(hpcinfer's pooling mode, or None where modules.json has no Pooling module; whether a
    Normalize module L2-normalises) from modules.json, refusing any module hpcinfer does not compute."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = read_model_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelError("modules.json is not a list of modules", path=str(modules_file))
    mode, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        name = kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") or name not in _COMPUTED:
            raise ModelError(
                f"module {kind!r} is not supported (hpcinfer computes sentence-transformers' "
                f"{', '.join(_COMPUTED[:3])})",
                path=str(modules_file),
            )
        folder = str(module.get("path", ""))
        if name == "Transformer" and folder not in ("", "."):
            raise ModelError(f"the Transformer module is in a subfolder ({folder!r})", path=str(modules_file))
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            if mode is not None:
                raise ModelError("more than one Pooling module", path=str(modules_file))
            pool_file = path / folder / "config.json"
            if not pool_file.is_file():
                raise ModelError("the Pooling module has no config.json", path=str(pool_file.parent))
            mode = pooling_mode(read_model_json(pool_file), pool_file)
    if mode is not None:
        check_transformer_output(path)
    return mode, normalize


def pooling_mode(cfg: Any, where: Path) -> str:
    """hpcinfer's name of the mode a Pooling config sets: the 6.x `pooling_mode` string, else the
    2.x-5.x flags (none set: `mean`, as 6.x reads them)."""
    if not isinstance(cfg, dict):
        raise ModelError("the Pooling config is not a JSON object", path=str(where))
    if "pooling_mode" in cfg:
        raw = cfg["pooling_mode"]
        modes = [str(m) for m in raw] if isinstance(raw, (list, tuple)) else [str(raw)]
    else:
        modes = [mode for key, mode in _FLAGS if cfg.get(key)] or ["mean"]
    if len(modes) != 1:
        raise ModelError(
            f"pooling concatenates several modes ({', '.join(map(repr, modes))}); hpcinfer pools with one",
            path=str(where),
        )
    # NOTE: 2.x-era configs and hpcinfer's own names spell some modes differently
    mode = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max", "mean_sqrt_len": "mean_sqrt_len_tokens",
            "last": "lasttoken"}.get(modes[0], modes[0])  # fmt: skip
    if mode not in _MODE_NAMES:
        raise ModelError(
            f"pooling mode {mode!r} is not supported (supported: {', '.join(_MODE_NAMES)})", path=str(where)
        )
    if cfg.get("include_prompt", True) is False:
        raise ModelError(
            "pooling leaves the prompt's tokens out (include_prompt: false), which hpcinfer does not do",
            path=str(where),
        )
    return _MODE_NAMES[mode]


def check_transformer_output(path: Path) -> None:
    """What the Pooling module pools must be the model's last hidden states over the text as it is:
    the only 6.x Transformer settings hpcinfer computes."""
    cfg = transformer_config(path)
    task = cfg.get("transformer_task", "feature-extraction")
    modalities = cfg.get("modality_config") or {}
    text = modalities.get("text") or {}
    output = (text.get("method", "forward"), text.get("method_output_name", "last_hidden_state"))
    if task != "feature-extraction" or output != ("forward", "last_hidden_state"):
        raise ModelError(
            f"the Transformer module's output ({task}: {output[0]} -> {output[1]}) is not the last hidden "
            "states hpcinfer pools",
            path=str(path),
        )
    if "message" in modalities:
        # NOTE: 6.x then renders every text as a chat message through the tokenizer's chat template
        raise ModelError(
            "the Transformer module embeds texts as chat messages (modality_config 'message'), rendered "
            "through the chat template, which hpcinfer's embedding does not do",
            path=str(path),
        )


__all__ = [
    "POOLING_MODES",
    "lowercases",
    "modules_pooling",
    "pooling_mode",
    "read_model_json",
    "transformer_config",
    "truncation_length",
]
