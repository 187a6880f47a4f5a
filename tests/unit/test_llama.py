"""The native decoder against transformers: logits for each family, RoPE type and weight layout."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hpcinfer.errors import ModelError
from hpcinfer.models.attention import DenseCausalAttention
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder, is_causal_lm
from tests.fixtures.tiny_decoder import build_tiny_decoder

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
# DeepSeek-style YaRN: the attention factor comes from mscale / mscale_all_dim, not from factor alone.
YARN_MSCALE = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
    "beta_fast": 16,
}
CASES = [
    ("LlamaForCausalLM", {}),
    ("MistralForCausalLM", {"shards": True}),
    ("Qwen2ForCausalLM", {"tie": True}),
    ("Qwen3ForCausalLM", {"head_dim": 24}),
    ("LlamaForCausalLM", {"rope_scaling": LLAMA3, "attention_bias": True, "mlp_bias": True}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "kv_heads": 1}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}),
    ("Qwen2ForCausalLM", {"rope_scaling": YARN}),
    ("Qwen3ForCausalLM", {"rope_scaling": YARN_MSCALE, "head_dim": 24}),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("arch", "extra"), CASES, ids=lambda c: c if isinstance(c, str) else "-".join(map(str, c)))
def test_logits_equal_transformers(tmp_path, arch, extra):
    path = build_tiny_decoder(tmp_path / "ckpt", arch, seed=3, **extra)
    info = inspect_decoder(path)
    assert is_causal_lm(path) and info.config.architecture == arch
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    ref = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, info.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.logits(model(ids, torch.arange(len(ids)), DenseCausalAttention()))
        theirs = ref(ids[None]).logits[0]
    assert theirs.std() > 0.5  # an initializer_range of 0.1 gives logits that can disagree
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_unsupported_architecture_is_one_line(tmp_path):
    path = build_tiny_decoder(tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match=r"unsupported architecture 'GPT2LMHeadModel'") as err:
        inspect_decoder(path)
    assert "\n" not in str(err.value)


def test_unsupported_rope_type_is_named(tmp_path):
    path = build_tiny_decoder(tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="unsupported rope_scaling type 'mrope'"):
        inspect_decoder(path)


def test_legacy_rope_scaling_keys(tmp_path):
    """Checkpoints written before transformers 5 keep rope_theta beside rope_scaling {type: ...}."""
    path = build_tiny_decoder(tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(raw))
    cfg = inspect_decoder(path).config
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"type": "linear", "factor": 4.0, "rope_type": "linear"}


@pytest.mark.parametrize("extra", [{}, {"mlp_bias": True}], ids=["plain", "mlp-bias"])
def test_the_mlp_in_column_slices_equals_transformers(tmp_path, monkeypatch, extra):
    """On CPU gate and up run in column slices: 48 columns of 128 leaves a ragged last slice."""
    from hpcinfer.models import llama

    monkeypatch.setattr(llama, "matmul_slice_rows", lambda row_bytes: 48)
    calls = []
    sliced = llama.DecoderLayer._sliced_act
    monkeypatch.setattr(llama.DecoderLayer, "_sliced_act", lambda self, h, w: calls.append(w) or sliced(self, h, w))
    path = build_tiny_decoder(tmp_path / "ckpt", "LlamaForCausalLM", seed=4, **extra)
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, info.config.vocab_size, (200,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.logits(model(ids, torch.arange(len(ids)), DenseCausalAttention()))
        theirs = ref(ids[None]).logits[0]
    assert calls == [48] * info.config.num_layers  # every layer took the sliced path
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
