"""CUDA checks (tests/gpu_checks.py) under pytest: they run where CUDA exists and are skipped elsewhere.

benchmarks/gpu_check.sh runs the same checks without pytest on a bare GPU machine, and with
--dry-run on the CPU against the simulated device.
"""

from __future__ import annotations

import pytest

from hpcinfer.models.tiny import build_minilm_shaped

from .gpu_checks import CHECKS, TOKENIZER_DIR, Setup, check_staging_slots, sample_input


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


def test_the_staging_slot_check_catches_a_slot_written_mid_copy(tmp_path, tiny_model) -> None:
    # NOTE: on the simulated device, so CI shows the check can fail (its negative control) without a GPU
    check_staging_slots(Setup("simulated", tiny_model, sample_input(tmp_path, 60), tmp_path, 32))
