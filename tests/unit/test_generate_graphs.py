"""The static-shape decode path (decode_graphs.py), run eagerly on CPU: the twin of the CUDA graphs.

It must give the normal path's tokens, and its padding rows must write nowhere but the scratch
block. Capture itself needs CUDA: tests/gpu_checks.py checks it on a GPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hpcinfer.engine.decode_graphs import DecodeGraphs, buckets
from hpcinfer.engine.engine import Engine, EngineConfig, pool_reserve
from hpcinfer.engine.kvcache.block_manager import blocks_for
from hpcinfer.engine.kvcache.pools import CUDA_DEFAULT_FRACTION, KVCache, KVLayout, size_pool
from hpcinfer.engine.sequence import SamplingParams
from hpcinfer.errors import ConfigError
from hpcinfer.models.decoder_checkpoint import load_decoder
from hpcinfer.models.decoder_inspect import inspect_decoder
from hpcinfer.models.registry import load_tokenizer
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts
from ..gpu_checks import peak_allocated

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_torch_thread):
    path = build_tiny_decoder(tmp_path_factory.mktemp("graphs"), "LlamaForCausalLM", seed=21)
    info = inspect_decoder(path)
    model = load_decoder(info, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(path, 256)
    return model, [tokenizer.encode(t).ids for t in make_texts(24, seed=3)]


def test_buckets_are_powers_of_two_then_the_limit():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory=16 << 20),
        # chunked prefill and preemption: mixed steps run on the normal path, decodes between them static
        EngineConfig(max_num_seqs=12, max_num_batched_tokens=48, kv_cache_memory=96 << 10, block_size=8),
    ],
    ids=["plain", "preempting"],
)
def test_static_decode_gives_the_normal_paths_tokens(tiny, config):
    model, prompts = tiny
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    normal = Engine(model, config)
    static = Engine(model, EngineConfig(**{**_fields(config), "cuda_graphs": True}))
    want = [s.completion for s in normal.generate(prompts, params)]
    got = [s.completion for s in static.generate(prompts, params)]
    assert got == want
    graphs = static.runner.graphs
    assert graphs is not None and graphs.eager_runs > 0 and graphs.captured == 0
    assert static.blocks.num_blocks == static.cache.num_blocks - 1  # the scratch block is reserved
    if config.max_num_batched_tokens == 48:
        assert static.stats.preemptions > 0 and static.stats.continued_chunks > 0


def test_padding_rows_write_only_the_scratch_block(tiny):
    model, prompts = tiny
    engine = Engine(
        model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory=16 << 20, cuda_graphs=True)
    )
    graphs, cache, bs = engine.runner.graphs, engine.cache, engine.cache.layout.block_size
    seqs = [engine.add(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts[:3]]
    engine.step()  # the three prompts' prefill, on the normal path
    assert all(s.num_computed == s.num_tokens - 1 for s in seqs)
    scratch = range(graphs.scratch_block * bs, (graphs.scratch_block + 1) * bs)
    for _ in range(4):  # 3 rows in the bucket of 4: one padding row per step
        writes = {s.block_table[p // bs] * bs + p % bs for s in seqs for p in [s.num_tokens - 1]}
        before_k, before_v = cache.k_slots.clone(), cache.v_slots.clone()
        engine.step()
        changed = (cache.k_slots != before_k).flatten(2).any(-1).any(0)
        changed |= (cache.v_slots != before_v).flatten(2).any(-1).any(0)
        written = set(changed.nonzero().flatten().tolist())
        assert written - set(scratch) == writes  # each real row its own slot, padding the scratch block
        assert all(graphs.scratch_block not in s.block_table for s in seqs)
    assert graphs.eager_runs == 4 and graphs.bucket(3, 1) == (4, 1)


def test_buckets_never_gather_more_blocks_than_the_pool_holds(tiny):
    model, _ = tiny
    engine = Engine(model, EngineConfig(max_num_seqs=64, block_size=8, kv_cache_memory=256 << 10, cuda_graphs=True))
    graphs, blocks = engine.runner.graphs, engine.cache.num_blocks
    assert graphs.grid and all(r * w <= blocks for r, w in graphs.grid)
    assert graphs.bucket(1, graphs.width_buckets[-1]) is not None  # one longest sequence always fits
    assert graphs.bucket(64, graphs.width_buckets[-1]) is None  # that step runs on the normal path


def test_cuda_graphs_are_refused_on_cpu_by_the_job(tmp_path):
    from hpcinfer.config import DeviceConfig, GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig
    from hpcinfer.tasks.generate.job import run_generate

    from ..conftest import write_jsonl

    ckpt = build_tiny_decoder(tmp_path / "m", "LlamaForCausalLM", seed=2, max_positions=64)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello"}])
    cfg = RunConfig(
        input=InputConfig((str(src),)),
        model=str(ckpt),
        output=OutputConfig(str(tmp_path / "out.parquet")),
        pipeline=PipelineConfig(progress="off"),
        generate=GenerateConfig(max_tokens=4, kv_cache_memory="8MiB"),
        device=DeviceConfig(device="cpu", cuda_graphs=True),
    )
    with pytest.raises(ConfigError, match="--cuda-graphs needs a CUDA device"):
        run_generate(cfg)


def _fields(config: EngineConfig) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def _largest_bucket_bytes(model, config: EngineConfig, num_blocks: int) -> int:
    """Peak bytes of the decode graphs' static buffers and their largest bucket's forward, SDPA's math kernel."""
    layout = KVLayout.of(model.cfg, config.block_size, model.norm.dtype)
    cache = KVCache(layout, num_blocks, torch.device("cpu"))
    max_blocks = blocks_for(model.cfg.max_model_len, config.block_size)

    def build_and_run() -> None:
        graphs = DecodeGraphs(model, cache, num_blocks - 1, config.max_num_seqs, max_blocks)
        graphs.forward(*max(graphs.grid, key=lambda b: b[0] * b[1]))

    with sdpa_kernel(SDPBackend.MATH):  # what a mask with GQA gets on CUDA
        return peak_allocated(build_and_run)


def test_with_graphs_the_kv_pool_leaves_room_for_the_largest_decode_bucket(tiny, monkeypatch):
    # A GPU with 64 MiB free: the default pool takes 0.85 of it, and the decode graphs are
    # captured after it, their largest bucket gathering a whole layer's pool.
    model, _ = tiny
    free = 64 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    config = EngineConfig(max_num_seqs=64, cuda_graphs=True)
    layout = KVLayout.of(model.cfg, config.block_size, model.norm.dtype)
    cuda = torch.device("cuda")
    before = size_pool(layout, None, cuda)  # the pool as sized without the graphs in mind
    after = size_pool(layout, None, cuda, pool_reserve(model, config))
    used_before = before * layout.bytes_per_block + _largest_bucket_bytes(model, config, before)
    used_after = after * layout.bytes_per_block + _largest_bucket_bytes(model, config, after)
    assert used_before > free  # out of memory at start-up
    assert used_after <= free * CUDA_DEFAULT_FRACTION
    # a bound, not a wild guess: most of the budget is used (the bound assumes CUDA math kernel copies
    # the CPU one may skip)
    assert used_after >= 0.5 * free * CUDA_DEFAULT_FRACTION
    # the bound holds for every pool size, not only where the sizing landed
    peak = pool_reserve(model, config)
    for blocks in (64, 300, 1024, 5000):
        assert _largest_bucket_bytes(model, config, blocks) <= peak(blocks)


class _FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def wait_stream(self, other: _FakeStream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _FakeGraph:
    def replay(self) -> None:
        pass


class _FakeCuda:
    """torch.cuda's device, stream and graph calls, on the CPU: which stream is current, and which
    stream each capture was given (None: torch's process-wide capture stream, of the current device)."""

    def __init__(self) -> None:
        self.current_device = torch.device("cuda", 0)  # what torch.cuda means when given no device
        self.defaults: dict[torch.device, _FakeStream] = {}
        self.capture_stream = _FakeStream(self.current_device)  # torch.cuda.graph's default
        self.current: _FakeStream | None = None
        self.captures: list[_FakeStream | None] = []

    def _device(self, device: object) -> torch.device:
        return self.current_device if device is None else torch.device(device)  # type: ignore[arg-type]

    def current_stream(self, device: object = None) -> _FakeStream:
        d = self._device(device)
        if self.current is not None and self.current.device == d:
            return self.current
        return self.defaults.setdefault(d, _FakeStream(d))

    @contextlib.contextmanager
    def stream(self, s: _FakeStream) -> Iterator[None]:
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    @contextlib.contextmanager
    def device(self, d: object) -> Iterator[None]:
        before, self.current_device = self.current_device, self._device(d)
        try:
            yield
        finally:
            self.current_device = before

    @contextlib.contextmanager
    def graph(self, graph: _FakeGraph, pool: object = None, stream: _FakeStream | None = None, **_: object):
        self.captures.append(stream)
        with self.stream(stream if stream is not None else self.capture_stream):
            yield

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls = {
            "Stream": lambda device=None, **_: _FakeStream(self._device(device)),
            "current_stream": self.current_stream,
            "stream": self.stream,
            "device": self.device,
            "graph": self.graph,
            "CUDAGraph": _FakeGraph,
            "graph_pool_handle": object,
            "synchronize": lambda device=None: None,
        }
        for name, value in calls.items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_decode_graphs_warm_up_and_capture_on_one_stream_of_the_models_device(tiny, monkeypatch):
    # NOTE: the graphs' device is the cache's (the CPU here; cuda:1 for a second GPU's engine). The
    # warm-up's first calls allocate the stream's cuBLAS workspace: a capture on another stream
    # would allocate a second one, inside the graphs' pool.
    model, _ = tiny
    fake = _FakeCuda()
    fake.install(monkeypatch)
    cache = KVCache(KVLayout.of(model.cfg, 16, model.norm.dtype), 64, torch.device("cpu"))
    ran_on: list[_FakeStream] = []
    forward = DecodeGraphs.forward

    def recorded(self: DecodeGraphs, rows: int, width: int) -> torch.Tensor:
        ran_on.append(fake.current_stream())
        return forward(self, rows, width)

    monkeypatch.setattr(DecodeGraphs, "forward", recorded)
    graphs = DecodeGraphs(model, cache, 63, 4, 4, capture=True)
    assert graphs.captured == len(graphs.grid) == len(fake.captures) > 1
    streams = {id(s): s for s in ran_on}
    assert len(ran_on) > graphs.captured and len(streams) == 1, f"warm-up and capture on {len(streams)} streams"
    (stream,) = streams.values()
    assert all(s is stream for s in fake.captures), "a capture ran on torch's process-wide capture stream"
    assert stream.device == cache.k.device, f"captured on a stream of {stream.device}, for a cache on the CPU"
