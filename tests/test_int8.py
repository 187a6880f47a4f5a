"""Int8 weights on the CPU (--quantize int8|auto) against float32: the layer, the embedding job on
the packaged MiniLM, a cross-encoder, and the decoder of a causal LM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hpcinfer.api import run
from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.errors import ConfigError, OutputError
from hpcinfer.models.decoder_checkpoint import inspect_decoder, load_decoder
from hpcinfer.models.int8 import Int8Linear, available_engines, quantize_int8, smoothing
from hpcinfer.models.llama import DenseCausalAttention
from hpcinfer.models.tiny_decoder import build_tiny_decoder
from hpcinfer.tasks.generate.job import run_generate

from .conftest import make_texts, read_output, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


@pytest.mark.parametrize("engine", available_engines())
def test_an_int8_linear_is_the_float_linear_within_int8_rounding(engine):
    torch.manual_seed(0)
    linear = nn.Linear(384, 1536)
    layer = Int8Linear.from_linear(linear, engine)
    x = torch.randn(3, 50, 384)
    with torch.no_grad():
        ref = linear(x)
    out = layer(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert relative_error(out, ref) < 0.02
    assert relative_error(layer(x[0, :1]), ref[0, :1]) < 0.02  # one row: the decode shape


def test_a_few_rows_take_the_weight_only_kernel_and_agree_with_the_float_linear():
    """A decode step of a few sequences multiplies the int8 weight by bfloat16 activations."""
    torch.manual_seed(2)
    linear = nn.Linear(384, 512)
    layer = Int8Linear(linear.weight, linear.bias, available_engines()[0], weight_only_rows=4)
    calls = []
    original = torch._weight_int8pack_mm
    x = torch.randn(5, 384)
    with torch.no_grad():
        ref = linear(x)
    try:
        torch._weight_int8pack_mm = lambda *a: calls.append(a[0].shape) or original(*a)
        small, large = layer(x[:3]), layer(x)
    finally:
        torch._weight_int8pack_mm = original
    assert calls == [(3, 384)]  # 3 rows: weight-only; 5 rows: activations quantized
    assert relative_error(small, ref[:3]) < 0.02 and relative_error(large, ref) < 0.02


def test_smoothing_keeps_the_product_and_tames_an_outlier_channel():
    """SmoothQuant: x/s times w*s is x times w; with one activation channel 100x the others,
    plain int8 loses the small channels and smoothed int8 keeps them."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256)
    x[:, 7] *= 100.0
    with torch.no_grad():
        ref = linear(x)
    engine = available_engines()[0]
    plain = relative_error(Int8Linear.from_linear(linear, engine)(x), ref)
    smooth = smoothing(x.abs().amax(dim=0), linear.weight)
    smoothed = relative_error(Int8Linear.from_linear(linear, engine, smooth)(x), ref)
    assert smoothed < plain / 3, (plain, smoothed)


def embed_config(tmp_path, src, out: str, **device) -> RunConfig:
    return RunConfig(
        input=InputConfig((str(src),)),
        output=OutputConfig(str(tmp_path / out)),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(**device),
    )


def embeddings(path) -> tuple[list, np.ndarray]:
    table = read_output(path)
    return table.column("id").to_pylist(), np.stack(table.column("embedding").to_numpy(zero_copy_only=False))


def test_int8_embeddings_of_minilm_stay_close_to_float32_and_the_report_says_so(tmp_path):
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(160, seed=3))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run(embed_config(tmp_path, src, "f32.parquet"))
    report = run(embed_config(tmp_path, src, "i8.parquet", quantize="int8"))
    check = report.quantize
    assert check["chosen"] == "int8" and check["engine"] in available_engines() and check["rows"] == 32
    assert check["min_cosine"] >= 0.98, check
    ids, ref = embeddings(tmp_path / "f32.parquet")
    ids8, ours = embeddings(tmp_path / "i8.parquet")
    assert ids8 == ids
    cosine = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.98 and cosine.mean() >= 0.99, (cosine.min(), cosine.mean())
    assert not np.array_equal(ours, ref)  # int8 really ran
    # int8 enters the fingerprint: a float32 run cannot resume an int8 output
    with pytest.raises(OutputError):
        run(replace_output(embed_config(tmp_path, src, "i8.parquet"), resume=True))


def replace_output(config: RunConfig, **changes) -> RunConfig:
    from dataclasses import replace

    return replace(config, output=replace(config.output, **changes))


def test_auto_keeps_float32_below_the_cosine_bound_and_says_why(tmp_path):
    rows = [{"id": i, "text": t} for i, t in enumerate(make_texts(40, seed=4))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run(embed_config(tmp_path, src, "f32.parquet"))
    report = run(embed_config(tmp_path, src, "auto.parquet", quantize="auto", min_cosine=1.0))
    assert report.quantize["chosen"] == "float32"
    assert "min cosine" in report.quantize["reason"] or "not faster" in report.quantize["reason"]
    # float32 chosen: the very output a run without --quantize writes
    assert np.array_equal(embeddings(tmp_path / "auto.parquet")[1], embeddings(tmp_path / "f32.parquet")[1])


def test_auto_keeps_float32_where_int8_is_slower_on_this_cpu(tmp_path, monkeypatch):
    """A CPU without int8 dot products (no VNNI: int8 no faster than float32) is played by timing
    the int8 model 1 s slower: auto writes float32's output and says why, whatever the cosine."""
    from hpcinfer.tasks.embed import quantize

    timed = quantize._run_sorted

    def int8_slower(model, ids, lengths):  # noqa: ANN001, ANN202
        out, ms = timed(model, ids, lengths)
        int8 = any(isinstance(layer, Int8Linear) for layer in model.encoder.modules())
        return out, ms + (1000.0 if int8 else 0.0)

    monkeypatch.setattr(quantize, "_run_sorted", int8_slower)
    rows = [{"id": i, "text": t} for i, t in enumerate(make_texts(40, seed=4))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run(embed_config(tmp_path, src, "f32.parquet"))
    report = run(embed_config(tmp_path, src, "auto.parquet", quantize="auto", min_cosine=0.5))
    assert report.quantize["chosen"] == "float32"
    assert report.quantize["reason"] == "int8 was not faster on this CPU"
    assert report.quantize["int8_ms"] > report.quantize["float_ms"]
    assert np.array_equal(embeddings(tmp_path / "auto.parquet")[1], embeddings(tmp_path / "f32.parquet")[1])


def test_int8_refusals(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "a"}])
    with pytest.raises(ConfigError, match="around float32"):
        run(embed_config(tmp_path, src, "bf.parquet", quantize="int8", dtype="bfloat16"))
    with pytest.raises(ConfigError, match="--min-cosine"):
        run(embed_config(tmp_path, src, "x.parquet", quantize="auto", min_cosine=1.5))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_decoder(tmp_path_factory.mktemp("int8"), "Qwen2ForCausalLM", seed=5, hidden=128, intermediate=256)
    return path, inspect_decoder(path)


def test_an_int8_decoder_gives_the_float32_logits_within_int8_rounding(tiny):
    _, info = tiny
    cpu = torch.device("cpu")
    ref_model = load_decoder(info, cpu, torch.float32)
    model = load_decoder(info, cpu, torch.float32, "int8")
    assert isinstance(model.layers[0].qkv, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    ids = torch.randint(0, info.config.vocab_size, (24,))
    positions = torch.arange(24)
    with torch.inference_mode():
        ref = ref_model.logits(ref_model(ids, positions, DenseCausalAttention()))
        ours = model.logits(model(ids, positions, DenseCausalAttention()))
    # NOTE: a random model's logits are close together; the real model's agreement is a benchmark figure
    assert relative_error(ours, ref) < 0.1
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75, (ours.argmax(-1), ref.argmax(-1))


def test_a_generation_run_with_int8_weights(tiny, tmp_path):
    path, _ = tiny
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": t} for i, t in enumerate(make_texts(6, seed=9))])
    config = RunConfig(
        input=InputConfig((str(src),)),
        model=str(path),
        output=OutputConfig(str(tmp_path / "out.jsonl")),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(quantize="int8"),
        generate=GenerateConfig(max_tokens=6, kv_cache_memory="4MiB"),
    )
    report = run_generate(config)
    assert report.rows == 6 and len(read_output(tmp_path / "out.jsonl")) == 6


def test_quantize_int8_reaches_a_cross_encoders_layers(tmp_path):
    from hpcinfer.models.int8 import linear_layers
    from hpcinfer.models.registry import inspect_embedder, load_model
    from hpcinfer.models.tiny_classifier import build_tiny_classifier

    path = build_tiny_classifier(tmp_path / "ce", "bert", labels=("score",))
    info = inspect_embedder(path, "score")
    model = load_model(info, torch.device("cpu"), torch.float32, cpu_fast_path=False)
    layers = len(linear_layers(model.embedder))
    assert layers == 4 * info.config.num_hidden_layers
    quantize_int8(model.embedder, 256)
    assert not linear_layers(model.embedder)  # every one swapped
