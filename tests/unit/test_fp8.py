"""FP8 weights (--quantize fp8) and the FP8 KV cache (--kv-cache-dtype fp8) against bfloat16.

The FP8 matmul is `torch._scaled_mm` with row-wise scales, the call a GPU of compute capability
8.9+ runs; torch runs it on the CPU too, so these tests run the GPU's arithmetic here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
from hpcinfer.engine.attention.choice import attention_kind
from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.kvcache.pools import KVLayout
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.errors import ConfigError
from hpcinfer.models.attention import DenseCausalAttention
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_checkpoint import load_tokenizer as decoder_tokenizer
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.fp8 import FP8, Fp8Linear
from hpcinfer.models.registry import resolve_model_path
from hpcinfer.tasks.generate.chat import ChatRenderer
from hpcinfer.tasks.generate.job import run_generate
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, read_output, write_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BF16 = torch.bfloat16
CHATS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Give me a tip for better sleep.",
    "What is photosynthesis?",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_decoder(tmp_path_factory.mktemp("fp8"), "LlamaForCausalLM", seed=7, hidden=128, intermediate=256)
    return path, inspect_decoder(path)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("scaled_mm", [True, False], ids=["scaled_mm", "weight-only"])
def test_an_fp8_linear_is_a_bfloat16_linear_within_fp8_rounding(scaled_mm):
    torch.manual_seed(0)
    linear = nn.Linear(256, 192).to(BF16)
    fp8 = Fp8Linear(linear, use_scaled_mm=scaled_mm)
    assert fp8.qweight.dtype == FP8 and fp8.qweight.nbytes * 2 == linear.weight.nbytes
    assert fp8.use_scaled_mm == scaled_mm
    x = torch.randn(3, 40, 256, dtype=BF16)
    with torch.no_grad():
        got, want = fp8(x), linear(x)
    assert got.shape == want.shape and got.dtype == BF16
    # e4m3 keeps 3 mantissa bits: about 2-3% per element, averaging down over a dot product
    assert relative_error(got, want) < 0.04
    assert relative_error(fp8.weight, linear.weight) < 0.04


@pytest.fixture(scope="module")
def smollm2():
    info = inspect_decoder(resolve_model_path("smollm2"))  # a real model: random ones are chaotic
    return info, load_decoder(info, torch.device("cpu"), BF16), load_decoder(info, torch.device("cpu"), BF16, "fp8")


def test_fp8_weights_give_a_real_models_logits_within_tolerance(smollm2):
    info, bf16, fp8 = smollm2
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) == 4 * info.config.num_layers
    text = " ".join(CHATS * 8)
    ids = torch.tensor(decoder_tokenizer(info).encode(text).ids[:300])
    reference = load_decoder(info, torch.device("cpu"), torch.float32)
    logits = {}
    for name, model in (("float32", reference), ("bf16", bf16), ("fp8", fp8)):
        with torch.no_grad():
            logits[name] = model.logits(model(ids, torch.arange(len(ids)), DenseCausalAttention()))
    errors = {k: relative_error(logits[k], logits["float32"]) for k in ("bf16", "fp8")}
    top1 = {k: float((logits[k].argmax(-1) == logits["float32"].argmax(-1)).float().mean()) for k in errors}
    print(f"logits against float32: relative error {errors}, top-1 agreement {top1}")
    # measured: bfloat16 0.022 and 0.99; FP8 weights 0.16 and 0.95 (a 135M model, already 4-bit in its file)
    assert errors["bf16"] < 0.05 and top1["bf16"] >= 0.97
    assert errors["fp8"] < 0.25 and top1["fp8"] >= 0.9


def test_the_fp8_kv_pool_holds_twice_the_blocks_and_answers_agree(smollm2):
    info, model, _ = smollm2
    tokenizer = decoder_tokenizer(info)
    renderer = ChatRenderer(info.chat_template, info.special_tokens)
    prompts = [
        tokenizer.encode(renderer.render([{"role": "user", "content": q}], True), add_special_tokens=False).ids
        for q in CHATS
    ]
    engines, answers = {}, {}
    memory = 24 * KVLayout.of(info.config, 16, BF16).bytes_per_block  # 24 bfloat16 blocks
    for storage in (None, FP8):
        engine = Engine(model, EngineConfig(kv_cache_memory=memory, kv_storage=storage), info.eos_token_ids)
        engines[storage] = engine
        # NOTE: 8 tokens: what is checked is how the answers start (the agreement of whole answers is
        # the benchmark's); each further step of the six answers in bfloat16 took ~0.17 s on a CPU
        # without bfloat16 instructions (24 tokens: 9.9 s, 8 tokens: 4.6 s)
        answers[storage] = [s.completion for s in engine.generate(prompts, SamplingParams(max_tokens=8))]
    assert (engines[None].cache.num_blocks, engines[FP8].cache.num_blocks) == (24, 48)
    assert engines[FP8].cache.k.dtype == FP8 and engines[FP8].cache.nbytes == engines[None].cache.nbytes
    pairs = list(zip(answers[FP8], answers[None], strict=True))
    same = sum(a == b for a, b in pairs)
    first = sum(a[:4] == b[:4] for a, b in pairs)
    print(f"fp8 KV: {same}/{len(CHATS)} answers equal to bfloat16 KV, {first} in their first 4 tokens")
    # FP8 KV changes this small model's answers (measured on 100 chats: benchmarks/agreement/fp8_agreement.py);
    # the check here is that they start the same and are answers, not noise
    assert first >= len(CHATS) - 1
    assert all(len(a) > 4 for a, _ in pairs)


def test_kernels_that_cannot_read_fp8_kv_give_way_to_torch():
    layout = KVLayout(16, 8, 64, 256, BF16, FP8)
    assert attention_kind("auto", layout, torch.device("cuda")) == "torch"
    with pytest.raises(ConfigError, match="does not read an FP8 KV cache"):
        attention_kind("triton", layout, torch.device("cuda"))


def test_a_run_with_fp8_weights_and_kv_and_the_refusals(tiny, tmp_path):
    path, _ = tiny
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": t} for i, t in enumerate(make_texts(6, seed=9))])

    def config(out: str, model=path, **device) -> RunConfig:
        return RunConfig(
            input=InputConfig((str(src),)),
            model=str(model),
            output=OutputConfig(str(tmp_path / out)),
            pipeline=PipelineConfig(progress="off"),
            device=DeviceConfig(dtype="bfloat16", **device),
            generate=GenerateConfig(max_tokens=6, kv_cache_memory="4MiB", kv_cache_dtype="fp8"),
        )

    report = run_generate(config("out.jsonl", quantize="fp8"))
    assert report.rows == 6 and len(read_output(tmp_path / "out.jsonl")) == 6
    with pytest.raises(ConfigError, match="--quantize fp8 applies to causal LMs"):
        from hpcinfer.api import run

        run(config("emb.parquet", model="default", quantize="fp8"))
