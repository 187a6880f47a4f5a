"""CUDA checks (tests/gpu_checks.py) under pytest: they run where CUDA exists and are skipped elsewhere.

benchmarks/gpu_check.sh runs the same checks without pytest on a bare GPU machine, and with
--dry-run on the CPU against the simulated device. Every test here needs CUDA; the checks' negative
control, which does not, is tests/unit/test_gpu_checks.py.
"""

from __future__ import annotations

import pytest

from tests.fixtures.tiny import build_minilm_shaped

from ..gpu_checks import CHECKS, TOKENIZER_DIR, Setup, sample_input


@pytest.fixture(scope="module")
def on_cuda(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """A random all-MiniLM-L6-v2-shaped checkpoint (no download) and 300 rows of sample_data."""
    work = tmp_path_factory.mktemp("gpu")
    model = build_minilm_shaped(work / "minilm", TOKENIZER_DIR)
    return Setup("cuda", model, sample_input(work, 300), work, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_gpu_check(on_cuda: Setup, check) -> None:  # noqa: ANN001
    check(on_cuda)
