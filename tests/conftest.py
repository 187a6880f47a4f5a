"""Shared fixtures: a tiny random checkpoint, small request files, and a helper to run a job."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: before anything imports Triton (transformers does): its kernels then run in Triton's
    # interpreter, the only way they run without a GPU (engine/attention/triton_kernel.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # NOTE: `pytest -n 4` runs four workers on the machine's two cores: more torch threads each would
    # only contend for them. Subprocesses a test starts keep torch's default.
    torch.set_num_threads(1)

from hpcinfer.api import run
from hpcinfer.config import (
    DeviceConfig,
    GenerateConfig,
    InputConfig,
    OutputConfig,
    PipelineConfig,
    PlanConfig,
    RunConfig,
)
from hpcinfer.device.heap import keep_freed_memory
from hpcinfer.obs.progress import Progress
from tests.fixtures.tiny import build_tiny_bert
from tests.fixtures.warm_cli import warm_cli

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
keep_freed_memory()  # NOTE: the runs in this process keep their heap, as the command line's do

REPO = Path(__file__).resolve().parent.parent
SAMPLE_JSONL = REPO / "sample_data" / "requests.jsonl"
SAMPLE_PARQUET = REPO / "sample_data" / "requests.parquet"

WORDS = [
    *[
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "engineers",
        "measure",
        "latency",
        "and",
        "throughput",
        "of",
    ],
    *[
        "batched",
        "inference",
        "on",
        "pinned",
        "memory",
        "with",
        "streams",
        "events",
        "kernels",
        "tokens",
        "padding",
        "budget",
        "window",
    ],
]


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Deterministic texts of 1..80 words, lengths deliberately out of order."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 7, 20, 45, 80]))) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 64) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="session", autouse=True)
def _cli_processes_start_warm(tmp_path_factory: pytest.TempPathFactory):
    """`python -m hpcinfer ...` in a test forks from a server that imported torch and hpcinfer once
    (tests/fixtures/warm_cli.py): a real process, without ~2 s of imports each. The workers of one
    `pytest -n` share one server, in their run's temporary folder (pytest removes it with the run's
    others), where each one's would import the same modules (~4 s of CPU apiece)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        with warm_cli(tmp_path_factory.getbasetemp().parent / "warm-cli"):
            yield
        return
    with tempfile.TemporaryDirectory(prefix="hpcinfer-cli-") as folder, warm_cli(Path(folder)):
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture()
def requests_jsonl(tmp_path: Path) -> Path:
    texts = make_texts(300)
    return write_jsonl(tmp_path / "req.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])


def small_config(inputs: list[Path] | Path, output_path: Path, model: Path | str, **over: Any) -> RunConfig:
    """A config with small windows and budgets, so a few hundred rows make many batches (the
    encoder pipeline's: a generation run, which would refuse them, keeps its own)."""
    from hpcinfer.registry import pick_task

    paths = tuple(str(p) for p in (inputs if isinstance(inputs, list) else [inputs]))
    generates = pick_task(RunConfig(model=str(model), task=over.get("task", "auto"))) == "generate"
    cfg = RunConfig(
        input=InputConfig(paths, read_block_rows=50),
        model=str(model),
        plan=PlanConfig() if generates else PlanConfig(sort_window=120, max_batch_tokens=1024, max_batch_size=32),
        output=OutputConfig(str(output_path)),
        pipeline=PipelineConfig(progress="off"),
    )
    for section, values in over.items():
        cfg = (
            replace(cfg, **{section: replace(getattr(cfg, section), **values)})
            if isinstance(values, dict)
            else (replace(cfg, **{section: values}))
        )
    return cfg


def generate_config(
    src: Path, out: Path, model: Path | str, device: dict[str, Any] | None = None, **generate: Any
) -> RunConfig:
    """A generation run of `src` into `out`, no progress output, a small KV pool unless told."""
    return RunConfig(
        input=InputConfig((str(src),)),
        model=str(model),
        output=OutputConfig(str(out)),
        pipeline=PipelineConfig(progress="off"),
        device=DeviceConfig(**(device or {})),
        generate=GenerateConfig(**{"kv_cache_memory": "8MiB", **generate}),
    )


def tiny_llama(folder: Path, seed: int, prompts: int, max_length: int, text_seed: int, byte_level: bool = False):  # noqa: ANN201
    """(path, info, float32 model, prompt token ids) of a tiny random Llama and some of make_texts' texts;
    `byte_level`: with build_tiny_decoder's byte-level vocabulary of 268 tokens."""
    from hpcinfer.models.decoder_checkpoint import load_decoder
    from hpcinfer.models.decoder_inspect import inspect_decoder
    from hpcinfer.models.registry import load_tokenizer
    from tests.fixtures.tiny_decoder import build_tiny_decoder

    path = build_tiny_decoder(folder, "LlamaForCausalLM", seed=seed, byte_level=byte_level)
    info = inspect_decoder(path)
    ids = [load_tokenizer(path, max_length).encode(t).ids for t in make_texts(prompts, seed=text_seed)]
    return path, info, load_decoder(info, torch.device("cpu"), torch.float32), ids


def windows_committed(out: str | Path) -> int:
    """The windows an output's manifest lists as committed (0 before its first commit)."""
    try:
        return len(json.loads((Path(str(out) + ".parts") / "manifest.json").read_text())["windows"])
    except (OSError, ValueError, KeyError):
        return 0  # NOTE: not written yet, or caught between the write and the rename's readers


def read_output(path: str | Path) -> pa.Table:
    if str(path).endswith(".jsonl"):
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        return pa.Table.from_pylist([json.loads(line) for line in lines])
    return pq.read_table(path)


def run_job(cfg: RunConfig, **kwargs: Any):  # noqa: ANN201
    """Runs a job without progress output; returns (report, output table)."""
    report = run(cfg, progress=Progress("off"), **kwargs)
    return report, read_output(cfg.output.path)


def assert_a_late_fault_resumes_to_the_whole_run(tmp_path: Path, src: Path, model: Path | str, **over: Any) -> None:
    """A run (small_config with `over`) failing in a write of its last window keeps the windows it
    committed, and `--resume` then writes exactly what an uninterrupted run writes."""
    from hpcinfer.errors import StageError
    from hpcinfer.files.parts import has_commits

    report, whole = run_job(small_config(src, tmp_path / "whole.jsonl", model, **over))
    calls = {"n": 0}

    def fail_in_a_later_window(_item: Any) -> None:
        calls["n"] += 1
        if calls["n"] == report.batches - 1:  # NOTE: in the last window
            raise RuntimeError("injected fault")

    out = tmp_path / "part.jsonl"
    with pytest.raises(StageError):
        run(small_config(src, out, model, **over), progress=Progress("off"), hooks={"write": fail_in_a_later_window})
    assert has_commits(str(out))  # NOTE: windows committed before the fault are what the resume skips
    run_job(small_config(src, out, model, **over, output={"resume": True}))
    assert read_output(str(out)).to_pylist() == whole.to_pylist()


@pytest.fixture()
def children_left() -> Callable[[], list[psutil.Process]]:
    """The processes this test started that are still this process's children, when called: those
    it had before the test (what an earlier test left, as multiprocessing's resource tracker) are
    not the test's."""
    before = {p.pid for p in psutil.Process().children()}
    return lambda: [p for p in psutil.Process().children() if p.pid not in before]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny generation models run faster on one torch thread than on two (far faster on shared cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The folder a test lives in says what it needs: unit/ runs in this process, integration/ starts
# processes (the CLI, a killed run, Ray, tensor-parallel ranks) or runs the long oracle, gpu/ needs CUDA.
# A CUDA test is also an integration test, so `-m unit` and `-m integration` split the suite in two.
FOLDER_MARKERS = {"unit": ("unit",), "integration": ("integration",), "gpu": ("gpu", "integration")}
TESTS = Path(__file__).resolve().parent


# The files a pass spends longest on (seconds of wall time per file, measured with two busy processes
# beside the suite), longest first. pytest-xdist hands out whole files in collection order
# (`--dist loadfile`; pytest_configure turns off its reordering by size), so these start first and a
# pass does not end waiting on a minute-long file handed out last while the other workers idle;
# every other file follows, the files with more tests first (xdist's own order).
LONGEST_FIRST = (
    "unit/test_decoder_families.py",  # 124 s
    "integration/test_object_store.py",  # 124 s
    "unit/test_generate_attention.py",  # 110 s
    "integration/test_tp_generate.py",  # 100 s
    "integration/test_commit_every.py",  # 97 s
    "integration/test_ray_generate.py",  # 92 s
    "unit/test_speculate.py",  # 88 s
    "integration/test_gguf.py",  # 86 s
    "integration/test_ray_engine.py",  # 81 s
    "integration/test_resume.py",  # 76 s
    "integration/test_serve.py",  # 70 s
    "unit/test_heap.py",  # 61 s
    "unit/test_generate_exact.py",  # 61 s
)


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist hands out files in the order collection gives them (`--no-loadscope-reorder`),
    LONGEST_FIRST's; the package's bytecode is written before any worker starts."""
    if hasattr(config.option, "loadscopereorder"):  # NOTE: pytest-xdist is there
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):  # NOTE: once, in the process that starts the workers
        _compile_ahead()
    config.pluginmanager.register(_LongestFilesFirst(), "hpcinfer-longest-files-first")


def _compile_ahead() -> None:
    """Writes the bytecode of hpcinfer and the test fixtures where Python is told not to
    (PYTHONDONTWRITEBYTECODE, as CI images often set).

    NOTE: there, every process of a run compiled what it imported of hpcinfer from source again:
    each pytest worker, the warm server (tests/fixtures/warm_cli.py; what it forks inherits its
    modules) and each process a test starts cold. Compiling all of it takes ~0.4 s of CPU once;
    reading bytecode stays allowed everywhere. Written atomically, and rewritten only where a source
    is newer.
    """
    import compileall
    import sys

    if not sys.dont_write_bytecode:
        return  # NOTE: Python writes it itself, as it imports
    for folder in (REPO / "hpcinfer", TESTS / "fixtures"):
        compileall.compile_dir(folder, quiet=2)


@pytest.hookimpl(tryfirst=True)  # NOTE: before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test by its folder; GPU-marked tests run only where CUDA exists
    (benchmarks/gpu_check.sh runs them there)."""
    import torch

    for item in items:
        for name in FOLDER_MARKERS.get(_name_in_tests(item.path).partition("/")[0], ()):
            item.add_marker(name)
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # NOTE: by marker, not keyword: every test under tests/gpu/ has the keyword "gpu" (its package's name)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)


@functools.cache  # NOTE: each file resolved once, however many tests it holds
def _name_in_tests(path: Path) -> str:
    """A test file's path under tests/ ("unit/test_x.py"), or its whole path outside it."""
    resolved = Path(path).resolve()
    return resolved.relative_to(TESTS).as_posix() if resolved.is_relative_to(TESTS) else str(resolved)


class _LongestFilesFirst:
    """LONGEST_FIRST's files in its order, then the others by their number of tests; each file's
    tests keep their order."""

    @pytest.hookimpl(trylast=True)  # NOTE: after pytest's own grouping of a module's tests by their fixtures
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        tests_in = Counter(_name_in_tests(item.path) for item in items)

        def key(i: int) -> tuple[int, int, str]:
            name = _name_in_tests(items[i].path)
            return rank.get(name, len(rank)), -tests_in[name], name

        items[:] = [items[i] for i in sorted(range(len(items)), key=key)]


_FROZEN_AT: list[Path] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At each test file's first test: what is alive then (the modules imported so far, session
    fixtures; the last file's module fixtures are torn down by now) is collected once and frozen
    out of the garbage collector's full passes.

    NOTE: a pytest worker holds torch, transformers and sentence-transformers, ~0.5 million
    objects, and every full collection (dozens a file, as tests allocate) walks them all: 11 s of
    76 in the decoder families' and tune's files. Frozen objects are still freed by reference
    counting; only a cycle among them would wait for the process's end.
    """
    import gc

    if _FROZEN_AT and _FROZEN_AT[-1] == item.path:
        return
    _FROZEN_AT[:] = [item.path]
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Everything back under the collector before the interpreter's own last collection (where
    native extensions check that what they made was freed)."""
    import gc

    gc.unfreeze()
