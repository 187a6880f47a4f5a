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
from hpcinfer.models import int8_kernels
from hpcinfer.models.attention import DenseCausalAttention
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.int8 import Int8Kernel, Int8Linear
from hpcinfer.models.int8_kernels import ROUNDING_SLACK, accurate_kernels, probe_kernels, rounding_error
from hpcinfer.models.int8_quantize import quantize_int8, smoothing
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, read_output, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


@pytest.mark.parametrize("kernel", accurate_kernels(), ids=lambda k: k.name)
def test_an_int8_linear_is_the_float_linear_within_int8_rounding(kernel):
    """An accurate kernel's error is what int8 rounding predicts (rounding_error), on a batch and
    on one row (the decode shape), whichever CPU runs it."""
    torch.manual_seed(0)
    linear = nn.Linear(384, 1536)
    layer = Int8Linear.from_linear(linear, kernel)
    x = torch.randn(3, 50, 384)
    with torch.no_grad():
        ref = linear(x)
    out = layer(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    bound = rounding_error(x, linear.weight, ref, kernel.reduce_range)
    assert relative_error(out, ref) <= ROUNDING_SLACK * bound, (relative_error(out, ref), bound)
    row, row_ref = x[0, :1], ref[0, :1]
    row_bound = rounding_error(row, linear.weight, row_ref, kernel.reduce_range)
    assert relative_error(layer(row), row_ref) <= ROUNDING_SLACK * row_bound


def test_a_few_rows_take_the_weight_only_kernel_and_agree_with_the_float_linear():
    """A decode step of a few sequences multiplies the int8 weight by bfloat16 activations (whose
    rounding, 2^-9 relative, is below an 8-bit activation grid's: the int8 bound covers it)."""
    torch.manual_seed(2)
    linear = nn.Linear(384, 512)
    kernel = accurate_kernels()[0]
    layer = Int8Linear(linear.weight, linear.bias, kernel, weight_only_rows=4)
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
    small_bound = rounding_error(x[:3], linear.weight, ref[:3], False)
    assert relative_error(small, ref[:3]) <= ROUNDING_SLACK * small_bound
    assert relative_error(large, ref) <= ROUNDING_SLACK * rounding_error(x, linear.weight, ref, kernel.reduce_range)


def test_the_rounding_model_predicts_an_exact_int8_product():
    """rounding_error against int8 arithmetic done in float64 (the kernels' contract: int8 x int8
    summed exactly): the prediction is right within a few percent, at 8 and 7 bits."""
    torch.manual_seed(3)
    x, w = torch.randn(200, 256).double(), torch.randn(384, 256).double()
    ref = x @ w.T
    w_step = w.abs().amax(dim=1, keepdim=True) / 127
    wq = (w / w_step).round() * w_step
    for reduce_range in (False, True):
        levels = 127 if reduce_range else 255
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
        step = (hi - lo) / levels
        zero = round(-lo / step)
        xq = ((x / step).round() + zero).clamp(0, levels).sub(zero) * step
        exact = relative_error(xq @ wq.T, ref)
        predicted = rounding_error(x, w, ref, reduce_range)
        assert abs(exact / predicted - 1) < 0.1, (reduce_range, exact, predicted)


AVX2_CHILD = """
import json, torch
from hpcinfer.models.int8_kernels import probe_kernels, accurate_kernels
print(json.dumps({p.kernel.name: [p.error, p.bound, p.accurate] for p in probe_kernels()}))
print(json.dumps([k.name for k in accurate_kernels()]))
from hpcinfer.process_end import end_process  # as the hpcinfer program ends
end_process(0)
"""


@pytest.mark.skipif(
    "avx2" not in int8_kernels.cpu_flags() or "onednn" not in int8_kernels.available_engines(),
    reason="oneDNN's AVX2 int8 path needs an x86-64 CPU with AVX2",
)
def test_onednn_on_avx2_saturates_and_is_never_chosen():
    """oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA: what an AVX2-only CPU runs) sums pairs of uint8 x
    int8 products in 16 bits: the probe finds its 8-bit error far above int8 rounding and keeps
    it out; with 7-bit activations it is accurate again."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", AVX2_CHILD], env=env, capture_output=True, text=True, check=True)
    probes, accurate = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    error, bound, ok = probes["onednn"]
    assert not ok and error > 5 * bound, probes
    assert probes["onednn-7bit"][2], probes
    assert "onednn" not in accurate and "onednn-7bit" in accurate


@pytest.fixture
def fbgemm_saturates(monkeypatch):
    """fbgemm at 8 bits made inaccurate, and the fastest: its outputs corrupted as a saturating
    kernel's are, its calls free; the probe's cache cleared around the test."""
    forward = Int8Linear.forward

    def corrupted(self, x):  # noqa: ANN001, ANN202
        out = forward(self, x)
        if self.kernel == Int8Kernel("fbgemm"):
            return out.clamp(-0.05, 0.05)  # a saturated sum loses the large products
        return out

    monkeypatch.setattr(Int8Linear, "forward", corrupted)
    probe_kernels.cache_clear()
    yield
    probe_kernels.cache_clear()


def test_an_inaccurate_kernel_is_never_chosen_whatever_its_speed(fbgemm_saturates, monkeypatch, tmp_path):
    if "fbgemm" not in int8_kernels.available_engines():
        pytest.skip("this torch build has no FBGEMM")
    assert Int8Kernel("fbgemm") not in accurate_kernels()
    # timed as the fastest: still not a candidate
    clock = iter(range(10**6))
    monkeypatch.setattr(int8_kernels.time, "perf_counter", lambda: float(next(clock)))
    picked = int8_kernels.pick_kernel(torch.randn(256, 128), 64)
    assert picked != Int8Kernel("fbgemm")
    rows = [{"id": i, "text": t} for i, t in enumerate(make_texts(40, seed=4))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    report = run(embed_config(tmp_path, src, "i8.parquet", quantize="int8", min_cosine=0.9))
    assert report.quantize["engine"] != "fbgemm"
    with pytest.raises(ConfigError, match="fbgemm is not accurate"):
        run(embed_config(tmp_path, src, "x.parquet", quantize="int8", int8_kernel="fbgemm"))


def test_no_accurate_kernel_refuses_int8_and_auto_keeps_float32(monkeypatch, tmp_path):
    """Every kernel inaccurate (as on a CPU whose every library saturates): int8 refused in one
    line that gives the probe's errors; auto writes float32 and says why."""
    forward = Int8Linear.forward
    monkeypatch.setattr(Int8Linear, "forward", lambda self, x: forward(self, x).clamp(-0.05, 0.05))
    probe_kernels.cache_clear()
    try:
        rows = [{"id": i, "text": t} for i, t in enumerate(make_texts(12, seed=4))]
        src = write_jsonl(tmp_path / "in.jsonl", rows)
        with pytest.raises(ConfigError, match="no int8 kernel is accurate on this CPU .*error"):
            run(embed_config(tmp_path, src, "i8.parquet", quantize="int8"))
        report = run(embed_config(tmp_path, src, "auto.parquet", quantize="auto"))
        assert report.quantize["chosen"] == "float32" and "no int8 kernel is accurate" in report.quantize["reason"]
    finally:
        probe_kernels.cache_clear()


def test_int8_below_min_cosine_is_refused_with_the_cosine(tmp_path):
    rows = [{"id": i, "text": t} for i, t in enumerate(make_texts(12, seed=4))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(ConfigError, match=r"--quantize int8 refused: int8's min cosine .* < --min-cosine 1"):
        run(embed_config(tmp_path, src, "i8.parquet", quantize="int8", min_cosine=1.0))


def test_smoothing_keeps_the_product_and_tames_an_outlier_channel():
    """SmoothQuant: x/s times w*s is x times w; with one activation channel 100x the others,
    plain int8 loses the small channels and smoothed int8 keeps them."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256)
    x[:, 7] *= 100.0
    with torch.no_grad():
        ref = linear(x)
    kernel = accurate_kernels()[0]
    plain = relative_error(Int8Linear.from_linear(linear, kernel)(x), ref)
    smooth = smoothing(x.abs().amax(dim=0), linear.weight)
    smoothed = relative_error(Int8Linear.from_linear(linear, kernel, smooth)(x), ref)
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
    assert check["chosen"] == "int8" and check["rows"] == 128  # 160 rows: every fifth calibrates
    assert check["min_cosine"] <= check["p1_cosine"] <= check["mean_cosine"]
    assert check["engine"] in [k.name for k in accurate_kernels()]
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
    # NOTE: the cosine is checked before any timing: below the bound, speed never gets a say
    assert report.quantize["min_cosine"] < 1.0 and "< --min-cosine 1" in report.quantize["reason"]
    assert report.quantize["int8_ms"] == report.quantize["float_ms"] == 0.0
    # float32 chosen: the very output a run without --quantize writes
    assert np.array_equal(embeddings(tmp_path / "auto.parquet")[1], embeddings(tmp_path / "f32.parquet")[1])


def test_auto_keeps_float32_where_int8_is_slower_on_this_cpu(tmp_path, monkeypatch):
    """A CPU without int8 dot products (no VNNI: int8 no faster than float32) is played by timing
    the int8 model ten times slower: auto writes float32's output and says why, whatever the cosine."""
    from hpcinfer.pipeline import quantize

    timed = quantize._run_sorted

    def int8_slower(model, ids, lengths):  # noqa: ANN001, ANN202
        out, ms = timed(model, ids, lengths)
        int8 = any(isinstance(layer, Int8Linear) for layer in model.encoder.modules())
        # NOTE: ten times its time and a second more: a busy machine stretches both timings by
        # seconds, so a fixed second alone could leave int8 ahead
        return out, 10 * ms + 1000.0 if int8 else ms

    monkeypatch.setattr(quantize, "_run_sorted", int8_slower)
    rows = [{"id": i, "text": t} for i, t in enumerate(make_texts(40, seed=4))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    run(embed_config(tmp_path, src, "f32.parquet"))
    report = run(embed_config(tmp_path, src, "auto.parquet", quantize="auto", min_cosine=0.5))
    assert report.quantize["chosen"] == "float32"
    assert report.quantize["reason"] == "int8 was not 1.11x faster on this CPU"
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


@pytest.mark.parametrize("kernel", accurate_kernels(), ids=lambda k: k.name)
def test_an_int8_decoder_gives_the_float32_logits_within_int8_rounding(tiny, kernel):
    _, info = tiny
    cpu = torch.device("cpu")
    ref_model = load_decoder(info, cpu, torch.float32)
    model = load_decoder(info, cpu, torch.float32, "int8", kernel.name)
    assert isinstance(model.layers[0].qkv, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    ids = torch.randint(0, info.config.vocab_size, (24,), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(24)
    with torch.inference_mode():
        ref = ref_model.logits(ref_model(ids, positions, DenseCausalAttention()))
        ours = model.logits(model(ids, positions, DenseCausalAttention()))
    # NOTE: a random model's logits are close together; the real model's agreement is a benchmark figure.
    # 7-bit activations double the activation grid's step, and so the error.
    assert relative_error(ours, ref) < (0.2 if kernel.reduce_range else 0.1)
    agreement = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agreement >= (0.5 if kernel.reduce_range else 0.75), (ours.argmax(-1), ref.argmax(-1))


def test_an_int8_decoder_that_loses_the_reference_texts_tokens_is_refused(tiny, monkeypatch):
    from hpcinfer.models import decoder_int8

    _, info = tiny
    monkeypatch.setattr(decoder_int8, "TOKEN_AGREEMENT_FLOOR", 1.01)  # no int8 model can keep every token
    with pytest.raises(ConfigError, match="int8 keeps under 101% of float32's next tokens"):
        load_decoder(info, torch.device("cpu"), torch.float32, "int8")


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
    from hpcinfer.models.int8_quantize import linear_layers
    from hpcinfer.models.registry import inspect_embedder, load_model
    from tests.fixtures.tiny_classifier import build_tiny_classifier

    path = build_tiny_classifier(tmp_path / "ce", "bert", labels=("score",))
    info = inspect_embedder(path, "score")
    model = load_model(info, torch.device("cpu"), torch.float32, cpu_fast_path=False)
    layers = len(linear_layers(model.embedder))
    assert layers == 4 * info.config.num_hidden_layers
    quantize_int8(model.embedder, 256)
    assert not linear_layers(model.embedder)  # every one swapped


def test_the_kernel_choice_follows_a_margin_not_timing_noise():
    """The first kernel in the libraries' order keeps the choice unless another is faster by
    KERNEL_MARGIN: a few percent either way, as two runs of one command time them, changes nothing."""
    first, other = Int8Kernel("onednn"), Int8Kernel("fbgemm")
    margin = int8_kernels.KERNEL_MARGIN
    for noise in (0.97, 1.0, 1.03, 1.0 - margin * 0.9):
        assert int8_kernels.preferred([first, other], {first: 1.0, other: noise}) == first
    assert int8_kernels.preferred([first, other], {first: 1.0, other: 1.0 - margin * 1.1}) == other
    assert int8_kernels.preferred([first, other], {first: 0.5, other: 1.0}) == first


def _named_kernels() -> list[str]:
    """Every kernel name --int8-kernel takes on this CPU (accurate here), the chosen-by-default first."""
    names = [k.name for k in accurate_kernels()]
    for engine in int8_kernels.available_engines():
        for name in (engine, f"{engine}-7bit"):
            if name not in names and int8_kernels.probe_kernel(Int8Kernel.parse(name)).accurate:
                names.append(name)
    return names


def test_a_resumed_int8_run_goes_on_with_the_kernel_its_output_began_with(tmp_path, tiny_model):
    """The kernel is recorded in the report and the resume fingerprint; `--int8-kernel auto` on
    --resume takes the recorded one (the rows of one output are computed one way), another named
    one is refused in one line, naming both (on the tiny model: the kernel's bookkeeping is tested,
    the default model's int8 accuracy above)."""
    from hpcinfer.errors import StageError
    from hpcinfer.obs.progress import Progress

    names = _named_kernels()
    began = [k.name for k in accurate_kernels()][-1]  # NOTE: where there is a choice, not the one auto picks first
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(90, seed=6))]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    small = {"quantize": "int8", "min_cosine": 0.5}  # NOTE: a 7-bit kernel keeps less; the kernel is what is tested

    def config(out: str, kernel: str, resume: bool = False) -> RunConfig:
        from dataclasses import replace

        cfg = embed_config(tmp_path, src, out, **small, int8_kernel=kernel)
        return replace(cfg, model=str(tiny_model), plan=replace(cfg.plan, sort_window=30),
                       output=replace(cfg.output, resume=resume))  # fmt: skip

    whole = run(config("whole.parquet", began))
    assert whole.quantize["engine"] == began and whole.config["device.int8_kernel"] == began

    def fail_in_the_third_window(pending) -> None:  # noqa: ANN001
        if pending.batch.window.window_id == 2:
            raise RuntimeError("injected fault")

    with pytest.raises(StageError):
        run(config("part.parquet", began), progress=Progress("off"), hooks={"write": fail_in_the_third_window})
    resumed = run(config("part.parquet", "auto", resume=True))
    assert resumed.quantize["engine"] == began and resumed.config["device.int8_kernel"] == began
    assert (tmp_path / "part.parquet").read_bytes() == (tmp_path / "whole.parquet").read_bytes()
    if len(names) > 1:
        other = next(n for n in names if n != began)
        with pytest.raises(StageError):
            run(config("again.parquet", began), progress=Progress("off"), hooks={"write": fail_in_the_third_window})
        with pytest.raises(OutputError, match=f"option int8_kernel differs \\(was '{began}', now '{other}'\\)"):
            run(config("again.parquet", other, resume=True))
