"""Whose fault a failed embedding run is: one device's, or not a device's at all.

The one classifier of embedding faults, used by the local several-device run (degrade.py) and by a
Ray replica (replica.py). A row's own problem never gets here: it is a reject. A user's problem
(bad input, a file that changed) ends the run as one line. A failure in a device's stages (stage,
execute, collect), or one the writer saw while awaiting a device's results, is that device's
fault and counts against its circuit breaker; one in a host stage (read, tokenize, plan, write)
is not a device's, and ends the run as it would on one device.
"""

from __future__ import annotations

from ..errors import DeviceHung, DeviceResultFailed, HpcinferError, StageError
from ..place.faults import DeviceFault, fault_text

DEVICE_STAGES = ("stage", "execute", "collect")  # a device's steps; tokenize, plan and write are the host's


def device_fault(exc: StageError, labels: list[str]) -> DeviceFault | None:
    """The device `exc` is the fault of, among the run's devices (`labels`, as `device_labels` names
    them: the stages of several devices carry their device's label), or None when it is no device's."""
    stage, _, where = exc.stage.partition("@")
    if len(labels) == 1 and stage in DEVICE_STAGES:
        where = labels[0]  # one device: its stages carry no device name
    if isinstance(exc.cause, DeviceResultFailed):
        where = labels[exc.cause.replica]  # a device's failure the writer saw first
    if isinstance(exc.cause, HpcinferError) or where not in labels:
        return None
    cause = exc.cause.__cause__ if isinstance(exc.cause, DeviceResultFailed) else exc.cause
    return DeviceFault(labels.index(where), fault_text(cause), isinstance(exc.cause, DeviceHung))
