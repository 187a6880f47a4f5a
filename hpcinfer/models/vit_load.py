"""CLIP's and SigLIP's image towers (models/vit.py) built from a checkpoint's own files, or from
transformers' tower where transformers already loaded one.

From the files: config.json's `vision_config` and the image tower's tensors (of model.safetensors
read by name, so an image run never reads the text tower; a pytorch_model.bin is read whole), with
no transformers at all: importing transformers' CLIP modules and building its tower took ~3.5 s of
every image run's start (2 cores). `CLIPModel`, sentence-transformers' CLIP folders and
`SiglipModel` name the tower's tensors alike; the sizes are read from the tensors' shapes, and the
layer and head counts, the activation, the norms' epsilon and SigLIP's `vision_use_head` from the
config (transformers' defaults where it is silent, and a legacy `vision_config_dict` over it as
transformers reads one). A sharded checkpoint, an activation vit.py does not fuse and a SigLIP
tower without its pooling head stay on transformers' towers (models/clip.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError
from .bert import can_pack_for_cpu
from .meta import empty_modules
from .vit import FUSED, VisionTower, VitShape

# transformers' CLIPVisionConfig / SiglipVisionConfig defaults, for a config.json silent on them
DEFAULTS = {
    "clip": {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip": {
        "num_hidden_layers": 12, "num_attention_heads": 12, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
    },
}  # fmt: skip
VISION = "vision_model."  # the image tower's tensors in every layout; CLIP's projection beside it
PROJECTION = "visual_projection.weight"


def tower_settings(raw: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """One tower's config as transformers reads config.json's `key` ("vision_config", "text_config"):
    over `defaults`; where a legacy `{key}_dict` is there too, transformers builds that one whole
    (every default filled in) and lets it override, so the defaults win over `key` then."""
    config, legacy = raw.get(key) or {}, raw.get(f"{key}_dict")
    if not isinstance(config, Mapping) or not isinstance(legacy or {}, Mapping):
        raise ModelError(f"config.json's {key} is not a mapping")
    return {**defaults, **config} if legacy is None else {**config, **defaults, **legacy}


def number(settings: Mapping[str, Any], key: str, kind: type = int) -> Any:
    """A config value as a number, or a ModelError naming it (a null or a string where one is due)."""
    try:
        return kind(settings[key])
    except (TypeError, ValueError):
        raise ModelError(f"config.json: {key} is {settings[key]!r}, not a number") from None


def uses_native(settings: Mapping[str, Any], clip: bool) -> bool:
    """Whether vit.py runs this tower: an activation it fuses, and SigLIP's pooling head."""
    return str(settings["hidden_act"]) in FUSED and (clip or bool(settings.get("vision_use_head", True)))


def vision_shape(
    model_type: str, settings: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> VitShape | None:
    """The tower's shape from its tensors' shapes (`shapes`, by checkpoint name) and its settings
    (`tower_settings`); None where this module cannot run it (`uses_native`). A tensor the tower
    needs and `shapes` lacks, or sizes that do not fit, are a ModelError naming them."""
    clip = model_type == "clip"
    if not uses_native(settings, clip):
        return None
    act = str(settings["hidden_act"])
    layers = number(settings, "num_hidden_layers")  # NOTE: as transformers builds it; a layer lacking is named below

    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise ModelError(f"the checkpoint lacks weights its vision tower needs: {name}")
        return tuple(shapes[name])

    hidden, channels, patch, _ = shape(f"{VISION}embeddings.patch_embedding.weight")
    heads = number(settings, "num_attention_heads")
    if heads <= 0 or hidden % heads:
        raise ModelError(f"the vision tower's {hidden} hidden units do not divide into {heads} heads")
    return VitShape(
        clip=clip,
        hidden=hidden,
        heads=heads,
        layers=layers,
        intermediate=shape(f"{VISION}encoder.layers.0.mlp.fc1.weight")[0] if layers else 0,
        channels=channels,
        patch=patch,
        positions=shape(f"{VISION}embeddings.position_embedding.weight")[0],
        projection=shape(PROJECTION)[0] if clip else 0,
        act=act,
        eps=number(settings, "layer_norm_eps", float),
        patch_bias=f"{VISION}embeddings.patch_embedding.bias" in shapes,
    )


# a checkpoint layer's tensor -> this module's (Q, K and V become parts of `qkv`)
LAYER_NAMES = {
    "layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn_out",
    "mlp.fc1": "ffn_in", "mlp.fc2": "ffn_out",
}  # fmt: skip
TOP_NAMES = {
    "embeddings.patch_embedding": "patch", "embeddings.position_embedding": "positions",
    "embeddings.class_embedding": "class_embedding", "pre_layrnorm": "pre_norm", "post_layernorm": "post_norm",
}  # fmt: skip


def layer_state(weights: Mapping[str, torch.Tensor], prefix: str, layers: int) -> dict[str, torch.Tensor]:
    """The encoder layers' tensors under `prefix` (CLIP's and SigLIP's image and text towers name
    them alike) as VitLayers' state: Q, K and V concatenated into `qkv`, the rest renamed."""
    state: dict[str, torch.Tensor] = {}
    start = f"{prefix}encoder.layers."
    for name, tensor in weights.items():
        if name.startswith(start):
            index, _, rest = name[len(start) :].partition(".")
            module, _, param = rest.rpartition(".")
            if module in LAYER_NAMES:
                state[f"layers.{index}.{LAYER_NAMES[module]}.{param}"] = tensor
    for i in range(layers):
        for param in ("weight", "bias"):
            parts = [f"{start}{i}.self_attn.{p}_proj.{param}" for p in "qkv"]
            state[f"layers.{i}.qkv.{param}"] = torch.cat([weights[p] for p in parts])
    return state


def layer_names(prefix: str, layers: int) -> list[str]:
    """The tensors `layers` encoder layers under `prefix` must have, by their checkpoint names."""
    modules = ["layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"] + [
        f"self_attn.{x}_proj" for x in ("q", "k", "v", "out")
    ]
    return [f"{prefix}encoder.layers.{i}.{m}.{p}" for i in range(layers) for m in modules for p in ("weight", "bias")]


def native_state(weights: Mapping[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's image tower tensors (by their names in every CLIP / SigLIP layout) as this
    module's state dict: Q, K and V concatenated into `qkv`, the rest renamed."""
    state = layer_state(weights, VISION, layers)
    for name, tensor in weights.items():
        if name == PROJECTION:
            state["projection.weight"] = tensor
        elif name.startswith(VISION) and not name.startswith(f"{VISION}encoder."):
            local = name[len(VISION) :]
            module, _, param = local.rpartition(".")
            if local.startswith("head."):
                state[local] = tensor
            elif module in TOP_NAMES:
                state[f"{TOP_NAMES[module]}.{param}"] = tensor
            elif local in TOP_NAMES:  # CLIP's class embedding: a parameter, not a module's
                state[TOP_NAMES[local]] = tensor
    return state


def checkpoint_names(shape: VitShape) -> list[str]:
    """The tensors a checkpoint must hold for a tower of `shape`, by their checkpoint names."""
    pair = ("weight", "bias")
    names = [f"{VISION}embeddings.patch_embedding.weight", f"{VISION}embeddings.position_embedding.weight"]
    if shape.clip:
        names += [f"{VISION}embeddings.class_embedding", PROJECTION]
        names += [f"{VISION}pre_layrnorm.{p}" for p in pair]
    names += layer_names(VISION, shape.layers)
    names += [f"{VISION}post_layernorm.{p}" for p in pair]
    if not shape.clip:
        head = ["probe", "attention.in_proj_weight", "attention.in_proj_bias"]
        head += [f"{m}.{p}" for m in ("attention.out_proj", "layernorm", "mlp.fc1", "mlp.fc2") for p in pair]
        names += [f"{VISION}head.{name}" for name in head]
    return names


def build_tower(
    shape: VitShape, weights: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype, cpu_fast_path: bool
) -> VisionTower:
    """The tower of `shape` holding `weights` (checkpoint names) on `device` in `dtype`, packed for
    the CPU where `cpu_fast_path` and the dtype allow (`can_pack_for_cpu`)."""
    missing = [name for name in checkpoint_names(shape) if name not in weights]
    if missing:
        raise ModelError(f"the checkpoint lacks weights its vision tower needs: {missing[0]}")
    with empty_modules():
        tower = VisionTower(shape)
    return adopt(tower, native_state(weights, shape.layers), device, dtype, cpu_fast_path)


def adopt(
    tower: Any, state: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype, cpu_fast_path: bool
) -> Any:
    """`tower` (made on empty modules) holding `state` on `device` in `dtype`, in eval mode, its
    layers packed for the CPU where `cpu_fast_path` and the dtype allow (`can_pack_for_cpu`)."""
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    wanted = tower.state_dict()
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ModelError(f"the checkpoint lacks weights its tower needs: {missing[0]}")
    for name, tensor in state.items():
        if name in wanted and tuple(tensor.shape) != tuple(wanted[name].shape):
            want = tuple(wanted[name].shape)
            raise ModelError(f"tower weight {name}: shape {tuple(tensor.shape)}, expected {want}")
    tower.load_state_dict({k: state[k] for k in wanted}, assign=True)
    tower.eval()
    if cpu_fast_path and can_pack_for_cpu(tower):
        tower.pack_for_cpu()
    return tower


def read_tower_weights(file: Path, prefix: str, projection: str) -> dict[str, torch.Tensor]:
    """One tower's tensors of a weights file (those under `prefix`, and `projection`), the other
    tower's left unread (safetensors)."""

    def wanted(name: str) -> bool:
        return name.startswith(prefix) or name == projection

    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as handle:
                return {k: handle.get_tensor(k) for k in handle.keys() if wanted(k)}  # noqa: SIM118
        except Exception as exc:  # safetensors raises its own error types
            raise ModelError(f"cannot load weights ({exc})", path=str(file)) from None
    from .checkpoint import load_weights

    return {k: v for k, v in load_weights(file).items() if wanted(k)}


def load_tower(
    path: Path,
    raw_config: Mapping[str, Any],
    key: str,
    defaults: Mapping[str, Any],
    runs: Callable[[dict[str, Any]], bool],
    prefix: str,
    projection: str,
    build: Callable[[dict[str, Any], dict[str, torch.Tensor]], Any],
) -> Any:
    """One tower of a CLIP / SigLIP checkpoint from its files alone: its settings (config.json's
    `key` over `defaults`), None where `runs` says they are not native or the weights are sharded
    (before any weight is read), else `build(settings, its tensors)`; a ModelError names the
    checkpoint, as the other loaders' errors do."""
    from .checkpoint import weights_file

    file = weights_file(path)
    try:
        settings = tower_settings(raw_config, key, defaults)
        if file is None or not runs(settings):
            return None
        return build(settings, read_tower_weights(file, prefix, projection))
    except ModelError as error:
        raise ModelError(error.reason, path=str(path)) from None


def load_vision_tower(
    path: Path, raw_config: Mapping[str, Any], device: torch.device, dtype: torch.dtype, cpu_fast_path: bool
) -> VisionTower | None:
    """A CLIP / SigLIP checkpoint's image tower, native, from its files alone; None where this
    module cannot run it (then transformers' tower runs)."""
    kind = str(raw_config.get("model_type"))

    def build(settings: dict[str, Any], weights: dict[str, torch.Tensor]) -> VisionTower | None:
        shape = vision_shape(kind, settings, {k: tuple(v.shape) for k, v in weights.items()})
        return None if shape is None else build_tower(shape, weights, device, dtype, cpu_fast_path)

    defaults = DEFAULTS["clip" if kind == "clip" else "siglip"]
    runs = lambda settings: uses_native(settings, kind == "clip")  # noqa: E731
    return load_tower(path, raw_config, "vision_config", defaults, runs, VISION, PROJECTION, build)


def native_tower(tower: Any, model_type: str, cpu_fast_path: bool) -> VisionTower | None:
    """The native tower of transformers' CLIP / SigLIP image tower (on its device, in its dtype),
    packed for the CPU where `cpu_fast_path` and the dtype allow (`can_pack_for_cpu`); None where it has an
    activation this module does not know, or (SigLIP) no pooling head.

    NOTE: it consumes `tower`: the native one shares its tensors, and packing rescales CLIP's MLP
    weights in place (vit.py), so transformers' tower is not to be run after."""
    config = (tower.vision_model if model_type == "clip" else tower).config.to_dict()
    config = {**DEFAULTS["clip" if model_type == "clip" else "siglip"], **config}
    weights = tower.state_dict()
    if not any(name.startswith(VISION) for name in weights):  # NOTE: transformers 5's SiglipVisionModel
        weights = {VISION + name: tensor for name, tensor in weights.items()}
    shape = vision_shape(model_type, config, {k: tuple(v.shape) for k, v in weights.items()})
    if shape is None:
        return None
    first = next(iter(weights.values()))
    return build_tower(shape, weights, first.device, first.dtype, cpu_fast_path)
