"""LoRA adapters served beside their base model: rows of different adapters in one step.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`): for each target
projection a pair A [r, in], B [out, r] and a scale (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA).
The base decoder's weights are never merged: each targeted linear becomes a `LoraLinear` that
computes the base output for every row of the step, then adds, for each adapter present in the
step, `(x[rows] @ A.T) @ B.T * scale` to that adapter's rows (one low-rank update per adapter
group, so a step mixing adapters costs the base forward plus small matmuls). The decoder fuses
q/k/v and gate/up: an adapter's q, k and v (or gate and up) pairs update their slices of the fused
output. Row 0 of the adapters is the base (no update). `LoraRows` says, before each forward, which
rows of the step belong to which adapter (the runner sets it from the step's sequences).

With --max-loras N the adapters wait in host memory (pinned, beside a CUDA device) and at most N
are on the device: a step's adapters are brought there before its forward, the least recently used
one that the step does not use leaving first. The scheduler keeps the running sequences' adapters
within N, so a step never needs more.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

# PEFT's module name -> (the decoder's linear, which part of its output: q, k, v / gate, up / all)
TARGETS = {
    "q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"), "qkv_proj": ("qkv", "all"),
    "o_proj": ("o_proj", "all"), "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"),
    "gate_up_proj": ("gate_up", "all"), "down_proj": ("down", "all"),
}  # fmt: skip
KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(slots=True)
class LoraUpdate:
    """One adapter's low-rank pair for one slice [start, end) of a linear's output."""

    start: int
    end: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [end - start, r]
    scale: float


@dataclass(slots=True)
class Adapter:
    name: str
    path: Path
    digest: str  # sha256 of its config and weights: resume fingerprints name it
    # (layer, linear) -> its updates
    updates: dict[tuple[int, str], list[LoraUpdate]] = field(default_factory=dict)


class LoraRows:
    """The step's rows of each adapter: [(adapter index, row indices or None for every row)], base
    excluded; and, with `most` > 0, which adapters are on the device (least recently used first)."""

    def __init__(self, most: int = 0) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.most = most
        self.linears: list[LoraLinear] = []
        self.resident: OrderedDict[int, None] = OrderedDict()
        self.loads = 0  # adapters brought to the device (with `most`)

    def set(self, adapters: list[int], device: torch.device) -> None:
        """`adapters`: each row's adapter (0: the base), in the step's row order."""
        present = sorted(set(adapters) - {0})
        if self.most:
            self._bring(present, device)
        if not present:
            self.groups = []
        elif len(present) == 1 and 0 not in adapters:
            self.groups = [(present[0], None)]  # NOTE: every row one adapter: no gather, no scatter
        else:
            rows = torch.tensor(adapters)
            self.groups = [(a, (rows == a).nonzero().flatten().to(device)) for a in present]

    def _bring(self, present: list[int], device: torch.device) -> None:
        """The step's adapters on the device, within `most` where the step allows (a beam search
        between steps may need one more than the running sequences: none of its own then leaves)."""
        for adapter in present:
            if adapter in self.resident:
                self.resident.move_to_end(adapter)
                continue
            while len(self.resident) >= self.most:
                old = next((a for a in self.resident if a not in present), None)
                if old is None:
                    break
                del self.resident[old]
                for linear in self.linears:
                    linear.pairs.pop(old, None)
            for linear in self.linears:
                if (host := linear.host.get(adapter)) is not None:
                    linear.pairs[adapter] = tuple(t.to(device, non_blocking=True) for t in host)  # type: ignore[assignment]
            self.resident[adapter] = None
            self.loads += 1


class LoraLinear(nn.Module):
    """A base linear plus the low-rank updates of the adapters whose rows are in the step.

    An adapter's pairs on one fused linear (q, k and v; gate and up) are fused too: their A stacked
    [sum r, in], their B (scale folded in) placed block by block in [out, sum r], so each adapter
    costs two matmuls and one scatter per linear whatever it targets."""

    def __init__(self, base: nn.Linear, rows: LoraRows, updates: dict[int, list[LoraUpdate]]) -> None:
        super().__init__()
        self.base, self.rows = base, rows
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # every adapter's fused pair
        for adapter, parts in updates.items():
            a = torch.cat([p.a for p in parts])
            b = a.new_zeros(base.out_features, a.shape[0])
            rank = 0
            for p in parts:
                r = p.a.shape[0]
                b[p.start : p.end, rank : rank + r] = p.b * p.scale
                rank += r
            if rows.most and base.weight.device.type == "cuda":
                a, b = a.cpu().pin_memory(), b.cpu().pin_memory()  # NOTE: copied to the device without a stall
            self.host[adapter] = (a, b)
        # the pairs on the device: all of them, or (with --max-loras) those `rows` brought there
        self.pairs = {} if rows.most else self.host
        rows.linears.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for adapter, rows in self.rows.groups:
            pair = self.pairs.get(adapter)
            if pair is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = (xs @ pair[0].t()) @ pair[1].t()
            if rows is None:
                out += delta
            else:
                out.index_add_(0, rows, delta)
        return out


def parse_loras(given: tuple[str, ...]) -> list[tuple[str, Path]]:
    """`--lora NAME=PATH` values -> [(name, folder)], each checked to be a PEFT LoRA folder."""
    out: list[tuple[str, Path]] = []
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora {item!r}: give NAME=PATH (a PEFT adapter folder)")
        folder = Path(path.strip()).expanduser()
        if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
            raise ConfigError(f"--lora {name}: {folder} holds no adapter_config.json and adapter_model.safetensors")
        if name.strip() in {n for n, _ in out}:
            raise ConfigError(f"--lora {name}: the name is given twice")
        out.append((name.strip(), folder))
    return out


def adapter_digest(folder: Path) -> str:
    """sha256 of an adapter's config and weights (resume fingerprints and kept models name it)."""
    digest = hashlib.sha256((folder / "adapter_config.json").read_bytes())
    digest.update((folder / "adapter_model.safetensors").read_bytes())
    return digest.hexdigest()


def load_adapter(name: str, folder: Path, cfg: Any, dtype: torch.dtype, device: torch.device) -> Adapter:
    """A PEFT LoRA adapter for a decoder of config `cfg` (models.decoder_config.DecoderConfig)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("modules_to_save"):
        raise ConfigError(f"--lora {name}: only plain LoRA adapters are served (not DoRA, nor modules_to_save)")
    if config.get("fan_in_fan_out"):
        raise ConfigError(f"--lora {name}: fan_in_fan_out adapters (GPT-2 style) are not served")
    weights = load_file(str(folder / "adapter_model.safetensors"))
    adapter = Adapter(name, folder, adapter_digest(folder))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        matched = KEY.search(key)
        if matched is None:
            raise ConfigError(f"--lora {name}: {key} is not a LoRA weight of a decoder layer's projection")
        layer, module, which = int(matched.group(1)), matched.group(2), matched.group(3)
        if module not in TARGETS or layer >= cfg.num_layers:
            raise ConfigError(f"--lora {name}: {module} of layer {layer} is not a projection this decoder has")
        pairs.setdefault((layer, module), {})[which] = tensor
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"--lora {name}: layer {layer} {module} lacks its lora_A or lora_B")
        r = ab["A"].shape[0]
        alpha = float(config.get("alpha_pattern", {}).get(module, config.get("lora_alpha", r)))
        rank = int(config.get("rank_pattern", {}).get(module, config.get("r", r)))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        linear, part = TARGETS[module]
        start, end = _slice(cfg, linear, part)
        a, b = ab["A"].to(device=device, dtype=dtype), ab["B"].to(device=device, dtype=dtype)
        if b.shape[0] != end - start:
            raise ConfigError(f"--lora {name}: layer {layer} {module} writes {b.shape[0]} outputs, not {end - start}")
        adapter.updates.setdefault((layer, linear), []).append(LoraUpdate(start, end, a, b, scale))
    return adapter


def _slice(cfg: Any, linear: str, part: str) -> tuple[int, int]:
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    spans = {
        ("qkv", "q"): (0, q), ("qkv", "k"): (q, q + kv), ("qkv", "v"): (q + kv, q + 2 * kv),
        ("qkv", "all"): (0, q + 2 * kv), ("o_proj", "all"): (0, cfg.hidden_size),
        ("gate_up", "gate"): (0, inter), ("gate_up", "up"): (inter, 2 * inter),
        ("gate_up", "all"): (0, 2 * inter), ("down", "all"): (0, cfg.hidden_size),
    }  # fmt: skip
    return spans[(linear, part)]


def attach(model: nn.Module, adapters: list[Adapter], most: int = 0) -> LoraRows:
    """Wraps the decoder's targeted linears (adapter k is index k + 1; 0 is the base); returns the
    rows object the runner fills before each forward. `most` > 0: at most that many adapters on the
    device at once (--max-loras); fewer adapters than that are all kept there."""
    rows = LoraRows(most if 0 < most < len(adapters) else 0)
    for index, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        for linear in ("qkv", "o_proj", "gate_up", "down"):
            where = (index, linear)
            updates = {k + 1: a.updates[where] for k, a in enumerate(adapters) if where in a.updates}
            if not updates:
                continue
            base = getattr(layer, linear, None)
            if not isinstance(base, nn.Linear):
                raise ConfigError(f"--lora: layer {index}'s {linear} is not a plain linear here (an expert layer?)")
            setattr(layer, linear, LoraLinear(base, rows, updates))
    return rows


def attach_adapters(
    model: nn.Module, given: list[tuple[str, Path]], cfg: Any, dtype: torch.dtype, device: torch.device, most: int = 0
) -> LoraRows:
    """`--lora`'s adapters loaded and attached to `model` on `device`; with `most` (--max-loras)
    below their count they are loaded into host memory, and brought to the device as steps need them."""
    where = torch.device("cpu") if 0 < most < len(given) else device
    return attach(model, [load_adapter(name, folder, cfg, dtype, where) for name, folder in given], most)
