"""Crash safety of each retrieval output kind: a run killed with SIGKILL once it has committed a
window (and written, not yet committed, the next one's part), then resumed from a new process,
writes exactly what an uninterrupted run writes.

The kinds: SPLADE sparse vectors, token embeddings, int8 embeddings (whose ranges come from the first
window, so a resumed run must reuse them rather than calibrate on the window it starts from), binary
embeddings, NER token labels and image embeddings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ..conftest import make_texts, windows_committed, write_jsonl
from ..fixtures.tiny_clip import build_tiny_clip
from ..unit.test_ner import build_token_classifier
from ..unit.test_sparse import build_splade

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
CRASH_RUN = Path(__file__).with_name("crash_run.py")
ROWS = 400
WINDOW = 40  # rows a window: ten windows, so the kill lands with some committed and some not
TOTAL_WINDOWS = ROWS // WINDOW

# kind: (model the kind runs, its options)
KINDS = {
    "sparse": ("splade", ["--task", "sparse"]),
    "token_embeddings": ("tiny", ["--task", "embed", "--output-value", "token_embeddings"]),
    "int8": ("tiny", ["--task", "embed", "--precision", "int8"]),
    "binary": ("tiny", ["--task", "embed", "--precision", "binary"]),
    "ner": ("ner", ["--task", "ner"]),
    "images": ("clip", ["--task", "embed", "--image-column", "image"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("kill-models")
    return {
        "tiny": tiny_model,
        "splade": build_splade(folder / "splade", seed=2),
        "ner": build_token_classifier(folder / "ner", seed=2),
        "clip": build_tiny_clip(folder / "clip", "clip", seed=2),
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(make_texts(ROWS, seed=31))]
    return write_jsonl(tmp_path_factory.mktemp("kill-input") / "in.jsonl", rows)


@pytest.fixture(scope="module")
def image_source(tmp_path_factory) -> Path:
    """400 small PNGs named by relative path."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("kill-images")
    rows = []
    for i in range(ROWS):
        Image.new("RGB", (24 + i % 40, 30), ((i * 7) % 256, (i * 13) % 256, (i * 29) % 256)).save(folder / f"{i}.png")
        rows.append({"id": f"r{i}", "image": f"{i}.png"})
    return write_jsonl(folder / "in.jsonl", rows)


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcinfer", "run", *args]


def _kill_after_a_window(args: list[str], out: Path) -> int:
    """Runs into `out` until a real SIGKILL of its own (tests/integration/crash_run.py) once its first
    window is committed and its second window's part is written but not yet in place; returns the
    windows then listed. A kill sent from here once the manifest showed a window would race the run:
    a test process kept off the cores for half a second (four workers and a busy machine on two
    cores) could find every window of a fast kind (400 small images) already written."""
    proc = subprocess.run([sys.executable, str(CRASH_RUN), "part_written", "2", *args, "-o", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, f"the run ended (exit {proc.returncode}) unkilled: {proc.stderr}"
    return windows_committed(out)


@pytest.mark.parametrize("kind", list(KINDS))
def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path, models, source, image_source, kind):
    model, options = KINDS[kind]
    rows = image_source if kind == "images" else source
    args = [str(rows), "--model", str(models[model]), *options, "--sort-window", str(WINDOW),
            "--progress", "off", "-q"]  # fmt: skip
    reference = tmp_path / "reference.parquet"
    # NOTE: the uninterrupted run goes alongside the killed one: each process spends most of its
    # seconds importing torch, and two cores import two at once.
    uninterrupted = subprocess.Popen(_command(*args, "-o", str(reference)), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    try:
        out = tmp_path / "killed.parquet"
        committed = _kill_after_a_window(args, out)
        _, stderr = uninterrupted.communicate(timeout=300)
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
    assert uninterrupted.returncode == 0, stderr
    assert 0 < committed < TOTAL_WINDOWS, f"{committed} of {TOTAL_WINDOWS} windows committed at the kill"
    assert not out.exists()

    resumed = subprocess.run(_command(*args, "-o", str(out), "--resume"), capture_output=True, text=True,
                             env=ENV, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert not Path(str(out) + ".parts").exists()
    got, want = pq.read_table(out), pq.read_table(reference)
    assert got.num_rows == want.num_rows == ROWS
    assert got.schema.metadata == want.schema.metadata  # NOTE: int8's ranges live there
    assert got.equals(want)
    assert out.read_bytes() == reference.read_bytes()  # NOTE: the same parts, merged the same way
