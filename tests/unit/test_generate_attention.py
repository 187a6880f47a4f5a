"""The attention seam: the choice at start-up, and the flash-attn path's plumbing against a CPU stand-in.

The stand-in implements `flash_attn_with_kvcache`'s documented contract in plain torch (paged
pools [num_blocks, block_size, Hkv, D], int32 block tables and context lengths, a causal mask
aligned to the bottom right), so the tables, lengths and chunk layout the engine hands the real
kernel are checked here; the kernel itself needs CUDA and the package.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hpcinfer.engine.attention import choice as attention_module
from hpcinfer.engine.attention.choice import attention_kind, choose_attention, flash_attn_problem, triton_problem
from hpcinfer.engine.attention.paged import FlashAttnPagedAttention, TorchPagedAttention, TritonPagedAttention
from hpcinfer.engine.engine import Engine, EngineConfig
from hpcinfer.engine.kvcache.pools import KVCache, KVLayout
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.errors import ConfigError
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.registry import load_tokenizer
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def stand_in_kernel(q, k_cache, v_cache, *, cache_seqlens, block_table, causal, window_size=(-1, -1), softcap=0.0):  # noqa: ANN001, ANN201
    """q [B, Sq, H, D] -> [B, Sq, H, D]: row b attends its first cache_seqlens[b] keys through
    block_table[b]; flash-attn 2's sliding window and soft cap as its docstring gives them: query i
    sees keys [i + n - sq - window_size[0], i + n - sq + window_size[1]]; softcap > 0 caps the scaled
    scores (cap * tanh(score / cap))."""
    from hpcinfer.models.attention import scaled_dot_product_attention

    assert causal and block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    out = torch.empty_like(q)
    left = window_size[0]
    for b in range(q.shape[0]):
        n, sq = int(cache_seqlens[b]), q.shape[1]
        kk = k_cache[block_table[b].long()].flatten(0, 1)[:n].transpose(0, 1)[None]
        vv = v_cache[block_table[b].long()].flatten(0, 1)[:n].transpose(0, 1)[None]
        query, keys = torch.arange(n - sq, n)[:, None], torch.arange(n)[None, :]
        visible = (keys <= query) & ((keys >= query - left) if left >= 0 else True)
        got = scaled_dot_product_attention(q[b].transpose(0, 1)[None], kk, vv, visible, False, softcap or None)
        out[b] = got[0].transpose(0, 1)
    return out


def test_the_choice_is_made_once_with_clear_errors():
    cache = KVCache(KVLayout(1, 2, 8, 16, torch.float32), 4, torch.device("cpu"))
    assert isinstance(choose_attention(cache, torch.device("cpu")), TorchPagedAttention)  # auto on CPU
    assert isinstance(choose_attention(cache, torch.device("cpu"), "torch"), TorchPagedAttention)
    with pytest.raises(ConfigError, match="flash-attn needs a CUDA device"):
        choose_attention(cache, torch.device("cpu"), "flash-attn")
    with pytest.raises(ConfigError, match="--attention must be one of"):
        choose_attention(cache, torch.device("cpu"), "flashinfer")


def test_the_flash_attn_path_gives_the_torch_paths_tokens(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=8)
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(path, 256)
    prompts = [tokenizer.encode(t).ids for t in make_texts(16, seed=9)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    # a small step budget: chunked prefills (start > 0) next to decodes
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=40, kv_cache_memory=8 << 20, block_size=8)
    want = [s.completion for s in Engine(model, config).generate(prompts, params)]
    engine = Engine(model, config)
    engine.runner.attention = FlashAttnPagedAttention(engine.cache, stand_in_kernel)
    got = [s.completion for s in engine.generate(prompts, params)]
    assert engine.stats.continued_chunks > 0
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= len(prompts) - 1


def test_flash_attn_is_given_each_layers_window_and_the_soft_cap(tmp_path):
    """Gemma 2 (local and global layers in turn, soft-capped scores) through flash-attn's call, with
    a stand-in keeping its documented window and cap, its windows paged: the tokens of the torch
    path with every layer keeping every key."""
    arch, extra = WINDOWED["gemma2"]
    path = build_tiny_decoder(tmp_path / "m", arch, seed=4, **extra)
    model = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (3, 11, 22, 40)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, kv_cache_memory=8 << 20, block_size=4)
    want = [s.completion for s in Engine(model, replace(config, page_windows=False)).generate(prompts, params)]
    engine = Engine(model, config)
    engine.runner.attention = FlashAttnPagedAttention(engine.cache, stand_in_kernel)
    got = [s.completion for s in engine.generate(prompts, params)]
    assert engine.stats.continued_chunks > 0 and engine.cache.layout.paged_windows  # local layers: tables of their own
    assert got == want
    layout = engine.cache.layout
    assert "sinks" in flash_attn_problem(replace(layout, sinks=True, dtype=torch.bfloat16), torch.device("cuda"))


# --------------------------------------------------------------------------- the Triton kernel


def reference_attention(q, pool_k, pool_v, tables, rows, context):  # noqa: ANN001, ANN201
    """Each token: its table's blocks gathered, the first `context` keys, SDPA in float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        n = int(context[i])
        kk = pool_k[tables[rows[i]]].flatten(0, 1)[:n].float().transpose(0, 1)
        vv = pool_v[tables[rows[i]]].flatten(0, 1)[:n].float().transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(q[i].float()[:, None], kk, vv, enable_gqa=True)[:, 0]
    return out


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "dim", "block"),
    [(torch.float32, 4, 2, 16, 8), (torch.float32, 6, 2, 24, 4), (torch.float16, 8, 8, 32, 16)],
    ids=["gqa", "group-of-3-odd-dim", "half-mha"],
)
def test_the_triton_kernel_reads_blocks_in_place_as_the_reference_computes(dtype, heads, kv_heads, dim, block):
    from hpcinfer.engine.attention.triton_kernel import paged_attention

    gen = torch.Generator().manual_seed(3)
    pool_k = torch.randn(40, block, kv_heads, dim, generator=gen).to(dtype)
    pool_v = torch.randn(40, block, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(40, generator=gen)[:30].view(3, 10)  # 3 sequences, scattered blocks
    # decodes at block edges and mid-block, and a continued chunk's tokens (one table, growing context)
    rows = torch.tensor([0, 1, 2, 2, 2])
    context = torch.tensor([1, block, 10 * block, 3 * block + 1, 3 * block + 2])
    q = torch.randn(5, heads, dim, generator=gen).to(dtype)
    got = paged_attention(q, pool_k, pool_v, tables, rows, context)
    want = reference_attention(q, pool_k, pool_v, tables, rows, context)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)


@pytest.mark.parametrize(
    ("window", "softcap", "sinks"), [(5, None, False), (0, 1.5, False), (12, None, True), (7, 2.0, True)]
)
def test_the_triton_kernel_runs_windows_soft_caps_and_sinks_as_the_eager_reference(window, softcap, sinks):
    """A sliding-window layer (keys before the window, whole blocks of them skipped), Gemma 2's soft
    cap and gpt-oss's sinks, against transformers' eager formula (models.attention.eager_attention)."""
    from hpcinfer.engine.attention.triton_kernel import paged_attention
    from hpcinfer.models.attention import eager_attention, in_window

    block, heads, kv_heads, dim = 4, 4, 2, 16
    gen = torch.Generator().manual_seed(5)
    pool_k, pool_v = (torch.randn(40, block, kv_heads, dim, generator=gen) for _ in range(2))
    tables = torch.randperm(40, generator=gen)[:30].view(3, 10)
    rows = torch.tensor([0, 1, 2, 2, 2])
    context = torch.tensor([3, block, 10 * block, 3 * block + 1, 7 * block + 2])
    q = torch.randn(5, heads, dim, generator=gen) * 3  # large scores: the cap bites
    sink = torch.randn(heads, generator=gen) * 2 if sinks else None
    got = paged_attention(q, pool_k, pool_v, tables, rows, context, window=window, softcap=softcap, sinks=sink)
    for i in range(5):
        n = int(context[i])
        kk = pool_k[tables[rows[i]]].flatten(0, 1)[:n].transpose(0, 1)[None]
        vv = pool_v[tables[rows[i]]].flatten(0, 1)[:n].transpose(0, 1)[None]
        keys = torch.arange(n)
        mask = in_window(keys[-1:], keys, window) if window else None
        want = eager_attention(q[i][None, :, None], kk, vv, mask, False, softcap, sink)[0, :, 0]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-4)


def test_triton_is_refused_on_cpu_and_auto_keeps_torch_there():
    layout = KVLayout(1, 2, 8, 16, torch.float32)
    assert attention_kind("auto", layout, torch.device("cpu")) == "torch"
    with pytest.raises(ConfigError, match="triton needs a CUDA device"):
        attention_kind("triton", layout, torch.device("cpu"))
    assert "power of two" in triton_problem(KVLayout(1, 2, 8, 24, torch.float32), torch.device("cuda"))


def test_auto_on_cuda_reads_blocks_in_place_where_flash_attn_cannot_run(monkeypatch):
    # the gather path runs SDPA's math kernel on CUDA (a mask with GQA): K/V repeated per head in float32
    monkeypatch.setattr(attention_module, "flash_attn_problem", lambda layout, device: "not installed")
    monkeypatch.setattr(attention_module, "triton_build_problem", lambda: None)  # a compiler, whatever this host has
    layout = KVLayout(16, 8, 64, 16, torch.bfloat16)
    assert attention_kind("auto", layout, torch.device("cuda")) == "triton"
    assert attention_kind("auto", KVLayout(16, 8, 64, 24, torch.bfloat16), torch.device("cuda")) == "torch"


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-decode"])
def test_the_triton_path_gives_the_torch_paths_tokens(tmp_path, monkeypatch, static):
    monkeypatch.setattr(attention_module, "triton_problem", lambda layout, device: None)  # interpreted on the CPU
    path = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=8)
    model = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(path, 256)
    prompts = [tokenizer.encode(t).ids for t in make_texts(6, seed=9)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    # a small step budget: fresh and continued prefill chunks next to decodes
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, kv_cache_memory=8 << 20, block_size=8)
    want = [s.completion for s in Engine(model, config).generate(prompts, params)]
    engine = Engine(model, replace(config, attention="triton", cuda_graphs=static))
    assert isinstance(engine.runner.attention, TritonPagedAttention)
    got = [s.completion for s in engine.generate(prompts, params)]
    assert engine.stats.continued_chunks > 0
    assert got == want
    if static:
        assert engine.runner.graphs.eager_runs > 0 and engine.runner.graphs.attention.kernel is not None


# Gemma 2 (local and global layers in turn, soft-capped scores) and gpt-oss (local and global
# layers, sinks), windows small enough that prompts and answers cross them
WINDOWED = {
    "gemma2": ("Gemma2ForCausalLM", {"layers": 2, "head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 1.5}),
    "gpt_oss": ("GptOssForCausalLM", {"head_dim": 16, "sliding_window": 8, "num_local_experts": 4,
                                      "num_experts_per_tok": 2}),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(WINDOWED))
@pytest.mark.parametrize(("attention", "static"), [("torch", True), ("triton", False), ("triton", True)],
                         ids=["torch-static-decode", "triton", "triton-static-decode"])  # fmt: skip
def test_windows_soft_caps_and_sinks_give_the_torch_paths_tokens_on_every_path(
    tmp_path, monkeypatch, family, attention, static
):
    """The Triton kernel and the static decode (a CUDA graph's work, run eagerly here) attend within
    each layer's window through its paged window tables, cap the scores and weigh the sinks as the
    torch path does with every layer keeping every key."""
    monkeypatch.setattr(attention_module, "triton_problem", lambda layout, device: None)  # interpreted on the CPU
    arch, extra = WINDOWED[family]
    path = build_tiny_decoder(tmp_path / "m", arch, seed=4, **extra)
    model = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    assert any(model.cfg.layer_windows) and (model.cfg.attn_softcap or model.cfg.attn_sinks)
    gen = torch.Generator().manual_seed(6)
    # NOTE: the shortest row crosses the window in its answer, the others in their prompts; every
    # prompt token and step is a program of the interpreted kernel per key/value head and layer
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (3, 10, 16)]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, kv_cache_memory=8 << 20, block_size=4)
    want = [s.completion for s in Engine(model, replace(config, page_windows=False)).generate(prompts, params)]
    engine = Engine(model, replace(config, attention=attention, cuda_graphs=static))
    assert engine.cache.layout.paged_windows  # the local layers' own tables, freed behind the window
    got = [s.completion for s in engine.generate(prompts, params)]
    assert got == want
    if static:
        assert engine.runner.graphs.eager_runs > 0


# --------------------------------------------------------------------------- Triton's build needs


def _no_compiler(monkeypatch, tmp_path):  # noqa: ANN001, ANN202
    """A machine whose PATH has no C compiler and no CC: Triton cannot build its launcher there."""
    import shutil

    real_which = shutil.which
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **kw: None if name in ("cc", "gcc", "clang") else real_which(name, *a, **kw)
    )


def test_auto_falls_back_to_torch_where_triton_cannot_build_its_launcher(monkeypatch, tmp_path):
    # NOTE: Triton compiles a C launcher at its first kernel launch: without a compiler, auto would
    # pick it and crash at the first decode step
    monkeypatch.setattr(attention_module, "flash_attn_problem", lambda layout, device: "not installed")
    layout = KVLayout(16, 8, 64, 16, torch.bfloat16)
    _no_compiler(monkeypatch, tmp_path)
    assert attention_kind("auto", layout, torch.device("cuda")) == "torch"
    with pytest.raises(ConfigError, match="C compiler"):
        attention_kind("triton", layout, torch.device("cuda"))


def test_a_cc_that_is_not_there_is_named(monkeypatch, tmp_path):
    _no_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", "/nonexistent/bin/my-cc")
    why = triton_problem(KVLayout(16, 8, 64, 16, torch.bfloat16), torch.device("cuda"))
    assert why is not None and "/nonexistent/bin/my-cc" in why


def test_triton_is_refused_without_pythons_headers(monkeypatch, tmp_path):
    import sysconfig

    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **kw: {**real(*a, **kw), "include": str(tmp_path)})
    layout = KVLayout(16, 8, 64, 16, torch.bfloat16)
    with pytest.raises(ConfigError, match="Python.h"):
        attention_kind("triton", layout, torch.device("cuda"))
    monkeypatch.setattr(attention_module, "flash_attn_problem", lambda layout, device: "not installed")
    assert attention_kind("auto", layout, torch.device("cuda")) == "torch"


# --------------------------------------------------------------------------- one compiled kernel a run


def test_the_staged_step_arrays_start_on_16_byte_boundaries():
    # NOTE: Triton specialises a pointer on 16-byte alignment: a table or context view that moves
    # between aligned and not from step to step compiles the kernel again inside a timed run
    import numpy as np

    from hpcinfer.engine.staging import StepStaging

    rng = np.random.default_rng(0)
    staging = StepStaging(torch.device("cpu"), 64, copy=True)
    base = staging.on_device.data_ptr()
    for _ in range(300):
        shapes = [tuple(int(x) for x in rng.integers(0, 7, rng.integers(1, 3))) for _ in range(rng.integers(1, 12))]
        arrays = [rng.integers(0, 100, s) for s in shapes]
        views = staging.send(arrays)
        base = staging.on_device.data_ptr()
        for array, view in zip(arrays, views, strict=True):
            assert (view.data_ptr() - base) % 16 == 0 and view.data_ptr() % 16 == 0, [a.shape for a in arrays]
            assert view.shape == array.shape and (view.numpy() == array).all()


def test_the_table_stride_is_not_specialised():
    # NOTE: a step's table is as wide as its widest sequence: a stride Triton specialised on (1, or
    # a multiple of 16) would compile the kernel again whenever that changes
    from hpcinfer.engine.attention import triton_kernel as paged_kernel

    kernel = paged_kernel._kernel  # interpreted here (TRITON_INTERPRET), compiled on a GPU
    marked = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
    names = {kernel.arg_names[m] if isinstance(m, int) else m for m in marked or ()}
    assert "stride_table" in names


def test_the_kernel_sees_its_inputs_on_16_byte_boundaries_at_every_step(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_module, "triton_problem", lambda layout, device: None)
    path = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=8)
    model = load_decoder(inspect_decoder(path), torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(path, 256)
    prompts = [tokenizer.encode(t).ids for t in make_texts(10, seed=4)]
    config = EngineConfig(max_num_seqs=5, max_num_batched_tokens=24, kv_cache_memory=8 << 20, block_size=4)
    engine = Engine(model, replace(config, attention="triton"))
    seen: list[tuple[int, ...]] = []

    def recorder(q, pool_k, pool_v, tables, rows, context, **_reads):  # noqa: ANN001, ANN003, ANN202
        seen.append((tables.data_ptr() % 16, rows.data_ptr() % 16, context.data_ptr() % 16, tables.stride(0)))
        return reference_attention(q, pool_k, pool_v, tables, rows, context).to(q.dtype)

    engine.runner.attention.kernel = recorder
    engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len({s[3] for s in seen}) > 2  # steps of many table widths
    misaligned = [s for s in seen if s[:3] != (0, 0, 0)]
    assert not misaligned, f"{len(misaligned)} of {len(seen)} launches with inputs off a 16-byte boundary"
