"""Each decoder family beyond Llama/Mistral/Qwen in the paged engine, natively and with no flag.

Per family, a tiny random checkpoint saved by the installed transformers, 64 prompts of 16-300
token ids: greedy tokens equal transformers' `generate` (float32; tests/fixtures/tiny_decoder.py's
`transformers_greedy`: each answer confirmed by an unbatched forward, near ties generated one prompt
at a time); top-5 log-probabilities within 1e-4 of transformers' log-softmax on 8; n=2 seeded
sampling held to a JSON schema gives valid JSON (jsonschema); prefix caching on and off give the
same tokens; the CLI's default `--backend auto` runs it natively and the report says so.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import torch
from gguf import GGMLQuantizationType

from hpcinfer.engine.constrained.structured import Grammars, GrammarSpec
from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.errors import ConfigError, UnsupportedModel
from hpcinfer.models.decoder_checkpoint import load_decoder, load_tokenizer
from hpcinfer.models.decoder_config import DecoderConfig
from hpcinfer.models.decoder_inspect import inspect_decoder, open_gguf
from hpcinfer.parallel.decoder import rank_config
from tests.fixtures.tiny_decoder import build_tiny_decoder, transformers_greedy
from tests.fixtures.tiny_gguf import build_tiny_gguf

from ..conftest import generate_config, read_output, run_job, write_jsonl

MAX_TOKENS = 24
# family -> (transformers class, config beyond build_tiny_decoder's shape)
FAMILIES = {
    # Phi-3 / Phi-4: q/k/v and gate/up stored fused, RoPE on the first 3/4 of each head, LongRoPE
    # (short factors; cos/sin scaled by sqrt(1 + ln 4 / ln 512) for a 4x context)
    "phi3": (
        "Phi3ForCausalLM",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.15 * i for i in range(6)],
                "long_factor": [4.0] * 6,
            },
        },
    ),
    # Gemma 2: sliding-window layers alternating with global ones, tanh soft-capping of the
    # attention scores and of the logits (caps small enough to bite on a tiny random model),
    # sandwich norms with (1 + weight), scaled embeddings, GELU, query_pre_attn_scalar
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "layers": 4,
            "head_dim": 16,
            "sliding_window": 32,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.5,
            "final_logit_softcapping": 4.0,
        },
    ),
    # Gemma 3: sliding-window layers (a window of 32 tokens, crossed by every prompt) beside a
    # global one, local and global RoPE bases (linear scaling on the global), QK-norm, sandwich
    # norms with (1 + weight), embeddings scaled by sqrt(hidden), GELU, query_pre_attn_scalar
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "layers": 4,
            "head_dim": 16,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # mixtures of experts: 8 experts, 2 per token, grouped by expert over each step's tokens;
    # Qwen3-MoE with QK-norm, a dense MLP in its first layer (mlp_only_layers) and renormalised
    # top-k weights; Mixtral routing in every layer, always renormalised
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {
            "layers": 3,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # gpt-oss: per-head attention sinks, sliding-window and global layers in turn, YaRN, biased
    # q/k/v/o, a biased router softmaxing its top-k logits, biased experts whose clamped SwiGLU
    # (a limit small enough to bite here) reads gate and up interleaved
    "gpt_oss": (
        "GptOssForCausalLM",
        {"head_dim": 16, "sliding_window": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 0.5},
    ),
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, one_torch_thread):
    """(name, checkpoint, info, model, prompts, transformers' greedy answers, transformers' model)."""
    arch, extra = FAMILIES[request.param]
    path = build_tiny_decoder(tmp_path_factory.mktemp(request.param), arch, seed=7, max_positions=2048, **extra)
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 301, (64,), generator=g).tolist()
    prompts = [torch.randint(1000, 29000, (n,), generator=g).tolist() for n in lengths]
    ref, expected = transformers_greedy(path, arch, prompts, MAX_TOKENS, info.eos_token_ids)
    return request.param, path, info, model, prompts, expected, ref


def _greedy(family, prefix_cache: bool) -> list[list[int]]:
    """The 64 prompts, then 8 that share their first 64 tokens (blocks the prefix cache can share)."""
    _, _, info, model, prompts, _, _ = family
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_memory=64 << 20,
                          prefix_cache=prefix_cache)  # fmt: skip
    engine = Engine(model, config, info.eos_token_ids)
    shared = [prompts[0][:64] + p[:100] for p in prompts[:8]]
    return [s.completion for s in engine.generate(prompts + shared, SamplingParams(max_tokens=MAX_TOKENS))]


def test_greedy_tokens_equal_transformers_and_the_prefix_cache_changes_none(family):
    *_, prompts, expected, _ = family
    cached = _greedy(family, prefix_cache=True)
    assert cached == _greedy(family, prefix_cache=False)
    got = cached[: len(prompts)]
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    assert same == len(prompts), f"{same}/{len(prompts)} equal"
    assert len({tuple(a[:6]) for a in got}) > 32  # varied answers, not one repeated token
    assert sum(map(len, got)) > 64 * 8


def test_top5_logprobs_equal_transformers_log_softmax(family):
    _, _, info, model, prompts, _, ref = family
    engine = Engine(model, EngineConfig(max_num_seqs=8, kv_cache_memory=64 << 20), info.eos_token_ids)
    seqs = engine.generate(prompts[:8], SamplingParams(max_tokens=6, logprobs=5))
    worst = 0.0
    with torch.inference_mode():
        for prompt, seq in zip(prompts[:8], seqs, strict=True):
            keep = len(seq.completion) + 1  # the positions that predict the answer, and the last
            logits = ref(torch.tensor([prompt + seq.completion]), logits_to_keep=keep).logits[0, :-1]
            want = torch.log_softmax(logits.double(), dim=-1)
            for step, (chosen, top) in enumerate(seq.logprobs):
                assert len(top) == 5
                worst = max(worst, abs(chosen - float(want[step, seq.completion[step]])))
                for token, value in top:
                    worst = max(worst, abs(value - float(want[step, token])))
                assert [t for t, _ in top] == want[step].topk(5).indices.tolist()
    assert worst <= 1e-4, worst


def test_two_seeded_samples_held_to_a_json_schema_are_valid_json(family, tmp_path):
    """The family's checkpoint again, with a byte-level BPE vocabulary (a grammar needs one)."""
    arch, extra = FAMILIES[family[0]]
    path = build_tiny_decoder(tmp_path / "bytes", arch, seed=7, max_positions=2048, byte_level=True, **extra)
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(info)
    grammars = Grammars(tokenizer.to_str(), info.config.vocab_size, info.eos_token_ids)
    config = EngineConfig(max_num_seqs=8, kv_cache_memory=64 << 20)
    engine = Engine(model, config, info.eos_token_ids, grammars=grammars)
    prompts = [tokenizer.encode(f"person {i}:").ids for i in range(4)]
    structured = GrammarSpec.of("json_schema", SCHEMA)
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=3, n=2, structured=structured)
    answers = [sample.completion for seq in engine.generate(prompts, params) for sample in seq.all_samples]
    assert len(answers) == 8 and len({tuple(a) for a in answers}) > 1  # seeded samples differ
    for answer in answers:
        jsonschema.validate(json.loads(tokenizer.decode(answer)), SCHEMA)


def test_the_cli_default_runs_it_natively(family, tmp_path):
    path = family[1]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"say {i}", "max_tokens": 4} for i in range(3)])
    report, table = run_job(generate_config(src, tmp_path / "out.jsonl", path))
    assert report.backend == "native" and report.to_dict()["backend"] == "native"
    assert table.num_rows == 3
    assert read_output(tmp_path / "out.jsonl").num_rows == 3


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral", "qwen3_moe"], indirect=True)
def test_bfloat16_experts_batched_over_a_decode_step_equal_transformers_bfloat16_block(family, monkeypatch):
    """On a CPU in bfloat16, a decode step's experts run as one batched matmul (each expert its
    slots, a busier expert's rows beyond them on their own): the layer's output is transformers'
    sparse MoE block's in bfloat16 with the same weights, to bfloat16's rounding."""
    from hpcinfer.models import moe as moe_module

    _, _, _, model, _, _, ref = family
    index = next(i for i, layer in enumerate(model.layers) if layer.moe is not None)
    ours = copy.deepcopy(model.layers[index].moe).to(torch.bfloat16)
    theirs = copy.deepcopy(ref.model.layers[index].mlp).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(96, ours.router.shape[1], generator=g).to(torch.bfloat16)  # one token of 96 sequences
    monkeypatch.setattr(moe_module, "SLOTS_PER_MEAN_ROW", 1.0)  # fewer slots: some rows run past them
    # the batch is chosen where the CPU has bfloat16 instructions; its arithmetic is checked on any CPU
    monkeypatch.setattr(moe_module, "onednn_bfloat16", lambda: True)
    monkeypatch.setattr(moe_module, "cpu_has_bfloat16", lambda: True)
    experts, _ = ours.route(h)
    counts = torch.bincount(experts.flatten(), minlength=ours.router.shape[0])
    width = ours._batch_width(h, counts)
    assert 0 < width < int(counts.max())
    with torch.inference_mode():
        got = ours(h).float()
        want = theirs(h[None])
        want = (want[0] if isinstance(want, tuple) else want)[0].float()
    # bfloat16 keeps 8 significant bits: a few roundings of the largest output apart at most
    assert (got - want).abs().max() <= 2**-6 * want.abs().max()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999


def test_tensor_parallel_refuses_a_mixture_of_experts_in_one_line():
    import transformers

    shape = {"vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    raw = transformers.MixtralConfig(**shape).to_dict()
    cfg = DecoderConfig.from_hf({**raw, "architectures": ["MixtralForCausalLM"]})
    assert cfg.moe_layers and rank_config(cfg, 1) == cfg
    with pytest.raises(ConfigError, match=r"^--tp 2 does not split mixture-of-experts layers yet"):
        rank_config(cfg, 2)


def test_cuda_graphs_refuse_a_mixture_of_experts_in_one_line(tmp_path):
    """Its routing reads each step's expert counts on the host: a captured decode could not."""
    experts = {"num_local_experts": 4, "num_experts_per_tok": 2}
    path = build_tiny_decoder(tmp_path / "moe", "MixtralForCausalLM", seed=1, **experts)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "prompt_token_ids": [5, 6, 7]}])
    with pytest.raises(ConfigError, match=r"^--cuda-graphs with a mixture of experts is not built yet"):
        run_job(generate_config(src, tmp_path / "out.jsonl", path, device={"cuda_graphs": True}))


# family -> what a GGUF of it is written with: llama.cpp's conventions where the file stores nothing
# (Gemma 3: one global layer in six, queries scaled by 1/sqrt(head_dim))
GGUF_FAMILIES = {
    "phi3": ("Phi3ForCausalLM", {"pad_token_id": 0, **FAMILIES["phi3"][1]}),
    "gemma3": (
        "Gemma3ForCausalLM",
        {"layers": 6, "head_dim": 16, "sliding_window": 32, "query_pre_attn_scalar": 16, "rope_theta": 100000.0},
    ),
    # Gemma 2: soft caps from the file, one global layer in two
    "gemma2": (
        "Gemma2ForCausalLM",
        {"layers": 4, "head_dim": 16, "sliding_window": 32, "query_pre_attn_scalar": 16,
         "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0},
    ),
    # Mixtral: a llama with experts in llama.cpp's files (q/k rows permuted as llama's)
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # Qwen3-MoE: experts in every layer, renormalised, as llama.cpp runs them
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
         "norm_topk_prob": True},
    ),
    # gpt-oss as its published files hold it: MXFP4 experts, gate and up split from transformers'
    # interleaved columns, biased router and experts, sinks, every other layer sliding, YaRN
    "gpt_oss": (
        "GptOssForCausalLM",
        {"head_dim": 16, "sliding_window": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
         "experts_qtype": "MXFP4"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GGUF_FAMILIES))
def test_a_gguf_answers_as_the_checkpoint_it_was_written_from(tmp_path, name):
    """A GGUF as llama.cpp's converter writes one (Phi-3: fused attn_qkv, gate and up in ffn_up,
    rope.dimension_count, LongRoPE factors as tensors; Gemma 3: the window, norms holding 1 + weight;
    Qwen3-MoE: the router and each expert tensor stacked over the experts):
    the same greedy tokens, 16 prompts of 16-300 ids, as transformers running the checkpoint the
    file was written from."""
    arch, extra = GGUF_FAMILIES[name]
    hf = tmp_path / "hf"
    path = build_tiny_gguf(tmp_path / f"{name}.gguf", arch, hidden=64, intermediate=128, max_positions=2048, seed=5,
                           source=hf, **extra)  # fmt: skip
    info = inspect_decoder(path)
    assert info.gguf and info.config.architecture == arch
    cfg = info.config
    if name == "phi3":
        assert cfg.rotary_dim == 12 and cfg.rope_scaling["rope_type"] == "longrope"
    elif name == "gemma3":
        assert cfg.layer_windows == (32, 32, 32, 32, 32, 0) and cfg.local_rope_theta == 10_000.0
    elif name == "gemma2":
        assert cfg.layer_windows == (32, 0, 32, 0) and (cfg.attn_softcap, cfg.final_softcap) == (1.5, 4.0)
    elif name == "gpt_oss":
        assert cfg.moe_layers == (True, True) and cfg.attn_sinks and cfg.layer_windows == (32, 0)
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
        experts = open_gguf(path).tensors["blk.0.ffn_up_exps.weight"]
        assert GGMLQuantizationType(experts.tensor_type).name == "MXFP4"
    else:
        assert cfg.moe_layers == (True, True) and cfg.num_experts == 8 and cfg.renormalize_experts
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 255, (n,), generator=g).tolist() for n in torch.randint(16, 301, (16,), generator=g)]
    _, expected = transformers_greedy(hf, arch, prompts, MAX_TOKENS, info.eos_token_ids)
    engine = Engine(model, EngineConfig(max_num_seqs=8, kv_cache_memory=64 << 20), info.eos_token_ids)
    got = [s.completion for s in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    assert got == expected
    assert len({tuple(a[:6]) for a in got}) > 8


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from hpcinfer.models.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 135, (3, 8, 2), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [experts, rows, cols]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs)


def test_gpt_oss_with_mxfp4_experts_answers_as_its_dequantized_weights_do(tmp_path):
    """gpt-oss as published (MXFP4 experts): natively, the experts expanded at load give the greedy
    tokens transformers gives on the same weights in float."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    arch, extra = FAMILIES["gpt_oss"]
    source = build_tiny_decoder(tmp_path / "source", arch, seed=9, max_positions=2048, **extra)
    weights = load_file(str(source / "model.safetensors"))
    packed, dense = dict(weights), dict(weights)
    g = torch.Generator().manual_seed(1)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, columns = weights[name].transpose(1, 2).shape  # stored [experts, in, out]
        blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(114, 121, (experts, rows, columns // 32), generator=g, dtype=torch.uint8)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    folders = {}
    for kind, tensors in (("mxfp4", packed), ("float", dense)):
        folders[kind] = shutil.copytree(source, tmp_path / kind)
        save_file(tensors, str(folders[kind] / "model.safetensors"))
    config = json.loads((folders["mxfp4"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folders["mxfp4"] / "config.json").write_text(json.dumps(config))

    info = inspect_decoder(folders["mxfp4"])
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(1000, 29000, (n,), generator=g).tolist() for n in torch.randint(16, 301, (16,), generator=g)
    ]
    _, expected = transformers_greedy(folders["float"], arch, prompts, MAX_TOKENS, info.eos_token_ids)
    engine = Engine(model, EngineConfig(max_num_seqs=8, kv_cache_memory=64 << 20), info.eos_token_ids)
    got = [s.completion for s in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    assert got == expected
    assert len({tuple(a[:6]) for a in got}) > 8


def test_gpt_oss_quantized_otherwise_is_left_to_the_fallback():
    import transformers

    raw = transformers.GptOssConfig(vocab_size=100, hidden_size=64, num_attention_heads=4, head_dim=16).to_dict()
    raw |= {"architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(UnsupportedModel, match="bitsandbytes"):
        DecoderConfig.from_hf(raw)
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    assert DecoderConfig.from_hf(raw).attn_sinks


def test_int8_quantizes_a_mixture_of_experts_linear_layers_and_keeps_its_experts(tmp_path):
    """--quantize int8 on a model whose every layer routes to experts: its attention linears become
    int8 (the kernel timed on q/k/v, as there is no dense MLP), its experts stay float, it answers."""
    from hpcinfer.models.int8 import Int8Linear
    from hpcinfer.models.moe import MoE

    path = build_tiny_decoder(tmp_path, "MixtralForCausalLM", seed=3, hidden=256, intermediate=256,
                              num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32, quantize="int8")
    assert isinstance(model.layers[0].qkv, Int8Linear) and isinstance(model.layers[0].moe, MoE)
    engine = Engine(model, EngineConfig(max_num_seqs=4, kv_cache_memory=16 << 20), info.eos_token_ids)
    seqs = engine.generate([[5, 6, 7, 8] * 5] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(s.completion) for s in seqs] == [4, 4, 4]


def test_cpu_experts_are_laid_out_column_major_and_give_the_row_major_layers_output(tmp_path, monkeypatch):
    """Loaded for the CPU's expert-by-expert loop on an Intel CPU, each expert's weights keep their
    [out, in] shape with [in, out] memory (MKL's faster product there at a decode step's few rows:
    models/moe.py); the layer's output is the row-major layer's, to float32 rounding, at 16 rows an
    expert and fewer. On an AMD CPU, where MKL's products ran slower on them, the layout is kept."""
    from hpcinfer.models import int8_kernels

    path = build_tiny_decoder(tmp_path, "Qwen3MoeForCausalLM", seed=3, hidden=256, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=128)  # fmt: skip
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)  # NOTE: x86-64 wheels have it
    monkeypatch.setattr(int8_kernels, "cpu_vendor", lambda: "AuthenticAMD")
    kept = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    kept_moe = next(layer.moe for layer in kept.layers if layer.moe is not None)
    assert kept_moe.gate_up[0].is_contiguous() and kept_moe.down[0].is_contiguous()
    monkeypatch.setattr(int8_kernels, "cpu_vendor", lambda: "GenuineIntel")
    model = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    assert moe.gate_up.shape[1:] == (256, 256) and moe.down.shape[1:] == (256, 128)
    assert moe.gate_up[0].t().is_contiguous() and moe.down[0].t().is_contiguous()
    row_major = copy.deepcopy(moe)
    row_major.gate_up.data, row_major.down.data = moe.gate_up.contiguous(), moe.down.contiguous()
    assert row_major.gate_up[0].is_contiguous()
    for rows in (3, 64):  # about 1 and 16 rows an expert
        h = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            torch.testing.assert_close(moe(h), row_major(h), rtol=1e-5, atol=1e-6)


def test_bfloat16_experts_batch_only_where_the_cpu_computes_in_bfloat16(monkeypatch):
    """The batched form needs bfloat16 instructions (AVX-512 BF16, AMX): oneDNN emulates bfloat16 on
    other AVX-512 CPUs, where the batch ran slower than the loop. float32 and CUDA never batch."""
    from hpcinfer.models import int8_kernels
    from hpcinfer.models import moe as moe_module
    from hpcinfer.models.moe import MoE

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    monkeypatch.setattr(moe_module, "onednn_bfloat16", lambda: True)
    monkeypatch.setattr(int8_kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512_vnni"}))
    assert not MoE.may_batch(cpu, bf16)
    for flag in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(int8_kernels, "cpu_flags", lambda flag=flag: frozenset({"avx512f", flag}))
        assert MoE.may_batch(cpu, bf16)
    assert not MoE.may_batch(cpu, torch.float32) and not MoE.may_batch(torch.device("cuda"), bf16)
