"""Recipes: every shipped recipe loads and runs a tiny job; unknown keys name themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import REPO, write_jsonl

RECIPES = sorted((REPO / "recipes").glob("*.toml"))


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_runs_a_tiny_job(recipe, tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": f"row number {i}"} for i in range(20)])
    args = [str(src), "-o", str(tmp_path / "out.parquet"), "--model", str(tiny_model), "--config", str(recipe), "-q"]
    if "gpu" in recipe.stem and not torch.cuda.is_available():
        args += ["--device", "cpu", "--dtype", "float32"]  # flags override the recipe
        if "cuda-graphs = true" in recipe.read_text():
            proc = _run(*args, cwd=tmp_path)
            assert proc.returncode != 0 and "--cuda-graphs needs a CUDA device" in proc.stderr
            return
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.parquet").exists()
    assert recipe.read_text().lstrip().startswith("#"), "each recipe says when to use it"


def test_unknown_key_and_bad_value_are_named(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "x"}])
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nmax-batch-tokenz = 4096\n")
    proc = _run(str(src), "-o", "o.parquet", "--model", str(tiny_model), "--config", str(bad), cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "unknown key 'max-batch-tokenz'" in proc.stderr
    bad.write_text("streams = 'two'\n")
    proc = _run(str(src), "-o", "o.parquet", "--model", str(tiny_model), "--config", str(bad), cwd=tmp_path)
    assert proc.returncode != 0 and "key 'streams'" in proc.stderr and "Traceback" not in proc.stderr
