"""The GPU checks (tests/gpu_checks.py) can fail: their negative control, run without a GPU."""

from __future__ import annotations

from ..gpu_checks import Setup, check_staging_slots, sample_input


def test_the_staging_slot_check_catches_a_slot_written_mid_copy(tmp_path, tiny_model) -> None:
    # NOTE: on the simulated device, so CI shows the check can fail (its negative control) without a GPU
    check_staging_slots(Setup("simulated", tiny_model, sample_input(tmp_path, 60), tmp_path, 32))
