"""The GPU checks, as plain functions: `tests/gpu/test_gpu.py` runs them under pytest where CUDA exists,
and `benchmarks/gpu_check.sh` runs them directly (`python -m tests.gpu_checks`), since a bare GPU
machine may have no pytest. `--device simulated` runs every check on the CPU, against the simulated
asynchronous device (the dry run).

Each check raises AssertionError with what went wrong; none needs a download.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from hpcinfer.api import run
from hpcinfer.config import (
    DeviceConfig,
    InputConfig,
    OutputConfig,
    PipelineConfig,
    PlanConfig,
    RunConfig,
    TokenizeConfig,
)
from hpcinfer.device import Device, StagingRing, make_device
from hpcinfer.device.graphs import GraphRunner
from hpcinfer.obs.progress import Progress

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_data" / "requests.parquet"
TOKENIZER_DIR = REPO / "benchmarks" / "minilm_tokenizer"


def sample_input(work: Path, rows: int) -> Path:
    """The first `rows` rows of sample_data as a Parquet file."""
    path = work / f"requests-{rows}.parquet"
    if not path.exists():
        pq.write_table(pq.read_table(SAMPLE).slice(0, rows), path)
    return path


@dataclass(frozen=True)
class Setup:
    target: str  # the device under test: cuda, cuda:N, or simulated
    model: Path
    inputs: Path
    work: Path
    max_length: int  # rows are truncated to this: the dry run keeps CPU forwards short


def job(s: Setup, out: str, **device: Any) -> RunConfig:
    """Small windows and budgets, so a few hundred rows make dozens of batches."""
    return RunConfig(
        input=InputConfig((str(s.inputs),)),
        model=str(s.model),
        tokenize=TokenizeConfig(max_length=s.max_length),
        plan=PlanConfig(sort_window=120, max_batch_tokens=2048, max_batch_size=64),
        device=DeviceConfig(**device),
        output=OutputConfig(str(s.work / out), overwrite=True),
        pipeline=PipelineConfig(progress="off"),
    )


def embeddings(cfg: RunConfig, device: Device | None = None) -> tuple[Any, np.ndarray]:
    report = run(cfg, progress=Progress("off"), device=device)
    table = pq.read_table(cfg.output.path)
    values = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return report, np.asarray(values, dtype=np.float32).reshape(table.num_rows, -1)


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(((a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))).min())


# --------------------------------------------------------------------------- the checks


def check_device_equals_cpu(s: Setup) -> str:
    """float32 on the device equals the CPU, for 1/2/4 staging buffers and 1/2 compute streams."""
    _, reference = embeddings(job(s, "cpu.parquet", device="cpu", dtype="float32"))
    worst = 0.0
    for buffers, streams in [(1, 1), (2, 1), (2, 2), (4, 2)]:
        cfg = job(s, "dev.parquet", device=s.target, dtype="float32")
        cfg = replace(cfg, device=replace(cfg.device, staging_buffers=buffers, streams=streams))
        report, got = embeddings(cfg)
        assert report.device == s.target.split(":")[0], report.device
        np.testing.assert_allclose(got, reference, rtol=1e-3, atol=2e-4, err_msg=f"{buffers=} {streams=}")
        worst = max(worst, float(np.abs(got - reference).max()))
    return f"4 configurations, max |device - cpu| {worst:.2e}"


@contextlib.contextmanager
def _slot_written_after_its_copy(seen: list[bool]) -> Iterator[None]:
    """Records, at the moment the stage step writes into a staging slot, whether its last copy is done."""
    import hpcinfer.pipeline.stage

    local = threading.local()
    acquire, scatter = StagingRing.acquire, hpcinfer.pipeline.stage.scatter_rows

    def acquire_and_remember(self: StagingRing):  # noqa: ANN202
        local.slot = acquire(self)
        return local.slot

    def checked_scatter(*args: Any, **kwargs: Any) -> None:
        done = local.slot.h2d_done
        seen.append(done is None or done.query())  # queried before the write, not after a wait
        scatter(*args, **kwargs)

    StagingRing.acquire, hpcinfer.pipeline.stage.scatter_rows = acquire_and_remember, checked_scatter
    try:
        yield
    finally:
        StagingRing.acquire, hpcinfer.pipeline.stage.scatter_rows = acquire, scatter


def _slow_copies(device: Device) -> None:
    """Every H2D waits ~10 ms on the device first, so a slot reused too early is caught in the act."""
    launch = device.copy_stream.launch

    def slow(fn: Callable[[], None]) -> None:
        def delayed() -> None:
            if device.kind == "cuda":
                torch.cuda._sleep(10_000_000)  # ~10 ms of GPU clock cycles
            else:
                time.sleep(0.01)
            fn()

        launch(delayed)

    device.copy_stream.launch = slow  # type: ignore[method-assign]


def check_staging_slots(s: Setup) -> str:
    """No staging slot is written while its previous copy is in flight; and the check can fail."""
    results = {}
    for broken in (False, True):
        seen: list[bool] = []
        device = make_device(s.target, 1)
        _slow_copies(device)
        cfg = job(s, "slots.parquet", device=s.target, staging_buffers=1)
        cfg = replace(cfg, plan=replace(cfg.plan, max_batch_tokens=4 * s.max_length))  # many small batches
        original = StagingRing.__dict__["wait_reusable"]  # the staticmethod itself, to put back as it was
        try:
            if broken:  # the negative control: no wait before reuse
                StagingRing.wait_reusable = staticmethod(lambda slot: None)  # type: ignore[method-assign]
            with _slot_written_after_its_copy(seen):
                run(cfg, progress=Progress("off"), device=device)
        finally:
            StagingRing.wait_reusable = original  # type: ignore[method-assign]
            device.close()
        results[broken] = seen
    assert results[False] and all(results[False]), f"{results[False].count(False)} slots written mid-copy"
    assert not all(results[True]), "without the wait no slot was caught mid-copy: this check cannot fail"
    return f"{len(results[False])} writes, none mid-copy; without the wait {results[True].count(False)} were"


def check_graphs_equal_eager(s: Setup) -> str:
    """Graph replay equals the eager forward, every batch replayed a graph captured up front."""
    built: list[GraphRunner] = []
    init = GraphRunner.__init__

    def remember(self: GraphRunner, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    plan = {"max_batch_tokens": 4 * s.max_length, "max_batch_size": 32}  # a grid of a few dozen graphs
    eager_cfg = job(s, "eager.parquet", device=s.target, dtype="float32")
    eager_cfg = replace(eager_cfg, plan=replace(eager_cfg.plan, **plan))
    _, eager = embeddings(eager_cfg)
    cfg = replace(eager_cfg, device=replace(eager_cfg.device, cuda_graphs=True, streams=2))
    cfg = replace(cfg, output=replace(cfg.output, path=str(s.work / "graphs.parquet")))
    GraphRunner.__init__ = remember  # type: ignore[method-assign]
    try:
        report, graphs = embeddings(cfg)
    finally:
        GraphRunner.__init__ = init  # type: ignore[method-assign]
    (runner,) = built
    assert runner.graphs_captured > 0, "no graph was captured"
    assert runner.replays == report.batches and runner.eager == 0, (runner.replays, runner.eager, report.batches)
    np.testing.assert_allclose(graphs, eager, rtol=1e-3, atol=2e-4)
    diff = float(np.abs(graphs - eager).max())
    return f"{runner.graphs_captured} graphs captured, {runner.replays} replays, max diff {diff:.2e}"


def check_half_close_to_float32(s: Setup) -> str:
    """The default half dtype (bf16, or fp16 where unsupported) is close to float32, and really used."""
    half = "auto" if s.target.startswith("cuda") else "bfloat16"  # auto is float32 off CUDA
    _, f32 = embeddings(job(s, "f32.parquet", device=s.target, dtype="float32"))
    report, low = embeddings(job(s, "half.parquet", device=s.target, dtype=half))
    assert report.dtype in ("bfloat16", "float16"), f"--dtype {half} ran in {report.dtype}"
    cos = cosine_min(low, f32)
    assert cos > 0.999, f"min cosine {report.dtype} vs float32: {cos:.6f}"
    return f"{report.dtype}: min cosine vs float32 {cos:.6f}"


def random_decoder(device: torch.device, seed: int = 0, windows: tuple[int, ...] = ()) -> Any:
    """A tiny random Llama (no checkpoint, no tokenizer), float32, on `device`; `windows`: each
    layer's sliding window (0: every key), as Gemma's local and global layers have them."""
    from hpcinfer.models.decoder_config import DecoderConfig
    from hpcinfer.models.llama import LlamaDecoder

    cfg = replace(DecoderConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 1e-6, 512), layer_windows=windows)
    torch.manual_seed(seed)
    model = LlamaDecoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # matrices random; the RMSNorm scales stay 1
                p.normal_(0.0, 0.1)
    model = model.to(device).eval().requires_grad_(False)
    model.build_rope()
    return model


def check_generation_graphs(s: Setup) -> str:
    """Greedy generation on the device, with and without --cuda-graphs, gives the CPU's float32 tokens
    (eager step by step, and graphs a step ahead: the host plans step N+1 while step N runs).

    The graphs must really be captured and replayed on CUDA; on the simulated device (the dry run)
    the static-shape decode path runs eagerly on the CPU instead.
    """
    from hpcinfer.engine.engine import Engine, EngineConfig
    from hpcinfer.engine.sequence import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, int(n)).tolist() for n in rng.integers(4, 60, 40)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    # NOTE: max_num_seqs 24 of 40 prompts: later prompts join running decodes (mixed steps, eager)
    base = EngineConfig(max_num_seqs=24, max_num_batched_tokens=256, kv_cache_memory=16 << 20)
    cpu = Engine(random_decoder(torch.device("cpu")), base)
    want = [q.completion for q in cpu.generate(prompts, params)]
    device = torch.device(s.target if s.target.startswith("cuda") else "cpu")
    model = random_decoder(device)
    # eager step by step, graphs a step ahead: both loops, on the device
    eager = [q.completion for q in Engine(model, replace(base, ahead=False)).generate(prompts, params)]
    engine = Engine(model, replace(base, cuda_graphs=True, ahead=True))
    graphed = [q.completion for q in engine.generate(prompts, params)]
    graphs = engine.runner.graphs
    assert graphs is not None
    if device.type == "cuda":
        assert graphs.captured > 0 and graphs.replays > 0, f"{graphs.captured} captured, {graphs.replays} replays"
    else:
        assert graphs.eager_runs > 0, "the static decode path never ran"
    same_eager = sum(a == b for a, b in zip(eager, want, strict=True))
    same_graphs = sum(a == b for a, b in zip(graphed, want, strict=True))
    same_pair = sum(a == b for a, b in zip(graphed, eager, strict=True))
    # NOTE: CUDA and CPU float32 kernels round differently; a near-tie may flip one greedy choice
    assert min(same_eager, same_graphs) >= len(prompts) - 2, f"vs cpu: eager {same_eager}, graphs {same_graphs}"
    assert same_pair >= len(prompts) - 1, f"graphs vs eager on {device}: {same_pair}/{len(prompts)}"
    return (
        f"{len(prompts)} prompts: eager {same_eager}, graphs {same_graphs} equal the CPU's tokens; "
        f"{graphs.captured} graphs captured, {graphs.replays} replays, {graphs.eager_runs} static steps run eagerly"
    )


def check_triton_attention(s: Setup) -> str:
    """The Triton paged kernel equals the reference on random pools (bfloat16 on CUDA), and generation
    with it gives the torch path's greedy tokens, eager and in decode graphs.

    On the dry run the kernel runs in Triton's interpreter (gpu_check.sh sets TRITON_INTERPRET=1).
    """
    from hpcinfer.engine.attention import choice as attention_choice
    from hpcinfer.engine.attention.triton_kernel import paged_attention
    from hpcinfer.engine.engine import Engine, EngineConfig
    from hpcinfer.engine.sequence import SamplingParams

    device = torch.device(s.target if s.target.startswith("cuda") else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1)
    pool_k, pool_v = (torch.randn(64, 16, 8, 64, generator=gen).to(device, dtype) for _ in range(2))
    tables = torch.randperm(64, generator=gen)[:48].view(4, 12).to(device)
    rows, context = torch.tensor([0, 1, 2, 3, 3], device=device), torch.tensor([1, 16, 150, 77, 78], device=device)
    q = torch.randn(5, 32, 64, generator=gen).to(device, dtype)
    got = paged_attention(q, pool_k, pool_v, tables, rows, context).float()
    diff = 0.0
    for i in range(5):
        n = int(context[i])
        kk = pool_k[tables[rows[i]]].flatten(0, 1)[:n].float().transpose(0, 1)
        vv = pool_v[tables[rows[i]]].flatten(0, 1)[:n].float().transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], kk, vv, enable_gqa=True)
        diff = max(diff, float((got[i] - want[:, 0]).abs().max()))
    assert diff < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"kernel vs reference: max diff {diff:.2e}"

    rng = np.random.default_rng(2)
    count = 16 if device.type == "cuda" else 6  # NOTE: the interpreter runs a kernel program at a time
    prompts = [rng.integers(3, 512, int(n)).tolist() for n in rng.integers(4, 60, count)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    base = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=16 << 20)
    model = random_decoder(device)
    want_tokens = [q.completion for q in Engine(model, replace(base, attention="torch")).generate(prompts, params)]
    with contextlib.ExitStack() as stack:
        if device.type != "cuda":  # the interpreter stands in for the GPU
            stack.callback(setattr, attention_choice, "triton_problem", attention_choice.triton_problem)
            attention_choice.triton_problem = lambda layout, device: None
        same = []
        for graphs in (False, True):
            engine = Engine(model, replace(base, attention="triton", cuda_graphs=graphs))
            assert engine.runner.attention.name == "triton", engine.runner.attention.name
            tokens = [q.completion for q in engine.generate(prompts, params)]
            same.append(sum(a == b for a, b in zip(tokens, want_tokens, strict=True)))
    assert min(same) >= len(prompts) - 1, f"triton vs torch greedy tokens: eager {same[0]}, graphs {same[1]}"
    kind = str(dtype).removeprefix("torch.")
    return f"kernel max diff {diff:.2e} ({kind}); greedy tokens equal torch's: eager {same[0]}, graphs {same[1]}"


def check_paged_windows(s: Setup) -> str:
    """A model with a sliding-window layer beside a full one, its windows paged on the device (a
    local table of their own, blocks freed behind the window: the torch path, on CUDA Triton's
    kernel, and the decode graphs), gives the CPU's greedy tokens with every layer keeping every
    key, holding fewer blocks."""
    from hpcinfer.engine.engine import Engine, EngineConfig
    from hpcinfer.engine.sequence import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, int(n)).tolist() for n in rng.integers(4, 60, 24)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)  # NOTE: answers cross the 16-token window
    base = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory=16 << 20, block_size=8)
    windows = (16, 0)
    cpu = Engine(random_decoder(torch.device("cpu"), windows=windows), replace(base, page_windows=False))
    want = [q.completion for q in cpu.generate(prompts, params)]
    device = torch.device(s.target if s.target.startswith("cuda") else "cpu")
    model = random_decoder(device, windows=windows)
    found = []
    ways = [("torch", False), ("torch", True)] + [("triton", False), ("triton", True)] * (device.type == "cuda")
    for attention, graphs in ways:
        engine = Engine(model, replace(base, attention=attention, cuda_graphs=graphs))
        assert engine.cache.layout.paged_windows and engine.runner.attention.name == attention
        got = [q.completion for q in engine.generate(prompts, params)]
        same = sum(a == b for a, b in zip(got, want, strict=True))
        # NOTE: CUDA and CPU float32 kernels round differently; a near-tie may flip one greedy choice
        assert same >= len(prompts) - 2, f"paged windows on {device} ({attention}) vs the CPU: {same}/{len(prompts)}"
        held, full = engine.blocks.peak_used, engine.blocks.peak_full_attention
        assert held < full, f"paged windows held {held} blocks, full attention {full}"
        way = attention + (" graphs" if graphs else "")
        found.append(f"{way} {same}/{len(prompts)} (blocks at the peak {held}, full attention {full})")
    return "paged windows equal the CPU's tokens: " + ", ".join(found)


def peak_allocated(fn: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator held for `fn` beyond what it held before, from the profiler's
    allocation events (every allocation and free, kernels' internal buffers included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def check_graph_memory_bound(s: Setup) -> str:
    """The decode graphs' capture window stays under the bound the KV pool leaves room for (pool_reserve).

    The window is the graphs' own work: the warm-up at the largest bucket and every capture. It
    opens on an engine built without graphs and run once (its pool, its step buffers, the current
    stream's cuBLAS workspace: all there before, in a real run too), with the graphs' static buffers
    made and their capture stream's cuBLAS workspace allocated (per stream, not per graph; not the
    bound's) before it. On CUDA: the allocator's peak in the window beyond what it held when the
    window opened. On the CPU (dry run): the profiler's peak of the largest bucket's forward on
    SDPA's math kernel (capture is CUDA's alone).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hpcinfer.device.cuda import CaptureStream
    from hpcinfer.engine.attention.paged import TritonPagedAttention
    from hpcinfer.engine.decode_graphs import DecodeGraphs
    from hpcinfer.engine.engine import Engine, EngineConfig, pool_reserve
    from hpcinfer.engine.sequence import SamplingParams

    device = torch.device(s.target if s.target.startswith("cuda") else "cpu")
    model = random_decoder(device)
    lines = []
    for kind in ("torch", "auto") if device.type == "cuda" else ("torch",):
        config = EngineConfig(max_num_seqs=32, kv_cache_memory=64 << 20, cuda_graphs=True, attention=kind)
        engine = Engine(model, replace(config, cuda_graphs=False))
        engine.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=4, ignore_eos=True))
        runner, cache = engine.runner, engine.cache
        kernel = runner.attention.kernel if isinstance(runner.attention, TritonPagedAttention) else None
        scratch, rows = cache.num_blocks - 1, config.max_num_seqs
        graphs = DecodeGraphs(model, cache, scratch, rows, runner.max_blocks, runner.vocab_chunk, kernel=kernel)
        if device.type == "cuda":
            stream = CaptureStream(device)
            largest = max(graphs.grid, key=lambda b: b[0] * b[1])
            stream.warm_up(lambda g=graphs, b=largest: g.forward(*b), times=1)
            stream.synchronize()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            graphs.capture(stream)
            measured = torch.cuda.max_memory_allocated(device) - before
            assert graphs.captured == len(graphs.grid), f"{graphs.captured} of {len(graphs.grid)} buckets captured"
        else:
            with sdpa_kernel(SDPBackend.MATH):
                measured = peak_allocated(lambda g=graphs: g.forward(*max(g.grid, key=lambda b: b[0] * b[1])))
        bound = pool_reserve(model, config)
        assert bound is not None
        limit, name = bound(cache.num_blocks), runner.attention.name
        assert measured <= limit, f"{name}: graphs took {measured / 2**20:.1f} MiB, the bound {limit / 2**20:.1f} MiB"
        lines.append(f"{name} {measured / 2**20:.1f} of {limit / 2**20:.1f} MiB")
        del engine, graphs
    return "decode graphs' capture window beside the pool: " + ", ".join(lines)


CHECKS = [
    check_device_equals_cpu,
    check_staging_slots,
    check_graphs_equal_eager,
    check_half_close_to_float32,
    check_generation_graphs,
    check_triton_attention,
    check_paged_windows,
    check_graph_memory_bound,
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or simulated (the dry run)")
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (benchmarks/speed/random_minilm.py)")
    p.add_argument("--rows", type=int, default=300, help="rows of sample_data each check embeds")
    p.add_argument("--max-length", type=int, default=128, help="truncate rows to this many tokens")
    p.add_argument("--deadline", type=float, default=None, metavar="S", help="start no check S s after the start")
    args = p.parse_args(argv)
    started = time.monotonic()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu_checks-") as tmp:
        work = Path(tmp)
        setup = Setup(args.device, args.model, sample_input(work, args.rows), work, args.max_length)
        for check in CHECKS:
            t0 = time.perf_counter()
            if args.deadline is not None and time.monotonic() - started > args.deadline:
                failed += 1  # NOTE: not checked is not passed
                print(f"SKIP {check.__name__}: past the --deadline", flush=True)
                continue
            try:
                what = check(setup)
                print(f"PASS {check.__name__} ({time.perf_counter() - t0:.1f} s): {what}", flush=True)
            except Exception:  # noqa: BLE001 - every check runs; each failure is reported
                failed += 1
                print(f"FAIL {check.__name__} ({time.perf_counter() - t0:.1f} s)", flush=True)
                traceback.print_exc(file=sys.stdout)
    print(f"gpu checks on {args.device}: {len(CHECKS) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
