"""Embedding on several devices, degrading instead of ending: a device fault restarts the run,
from its committed windows, on the devices whose circuit breakers let them work.

`run_once(config, devices, extras)` is one run of the job (job.run_embed_job); this module only
decides which devices the next one gets (place/breaker.py) and gathers what the report says of it.

Whose fault a failed run is (`device_fault`), used here and by a Ray replica (replica.py): one
device's, or not a device's at all. A row's own problem never gets here: it is a reject. A user's
problem (bad input, a file that changed) ends the run as one line. A failure in a device's stages
(stage, execute, collect), or one the writer saw while awaiting a device's results, is that
device's fault and counts against its circuit breaker; one in a host stage (read, tokenize, plan,
write) is not a device's, and ends the run as it would on one device.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..device import Device
from ..errors import DeviceHung, DeviceResultFailed, DevicesFailed, HpcinferError, StageError
from ..obs.progress import Progress
from ..obs.timing import Span
from ..place.breaker import Breaker, BreakerLog, DeviceFault, Transition, breaker_settings, fault_text
from ..place.devices import device_labels
from .given import RunExtras
from .report import RunReport


def run_degrading(
    config: RunConfig, devices: list[Device], extras: RunExtras, run_once: Callable[..., RunReport]
) -> RunReport:
    """Several devices: a device fault ends the pipeline, not the run. The fault counts against
    the device's breaker, and the run resumes from its committed windows on the devices whose
    breakers let them work (a breaker past its cool-down gives its device a trial at such a
    restart, renewed in place in `devices`); the rows of the uncommitted windows are redone
    there, exactly as `--resume` redoes them, so the output is the one an undisturbed run
    writes. The run fails only when every device is out, naming each."""
    labels = device_labels([str(d.torch_device) if d.kind == "cuda" else d.kind for d in devices])
    settings = breaker_settings(config.device)
    progress = extras.progress or Progress(config.pipeline.progress)
    marks: list[Span] = []  # NOTE: each transition is also an instant on the trace, on its device's track

    def tell(t: Transition) -> None:
        progress.breaker(t.device, t.state, f"hpcinfer: device {t.device} {t.state}: {t.reason}")
        at = int((log.start + t.at_s) * 1e9)  # the stages' clock: perf_counter, in ns
        marks.append(Span(f"breaker {t.state}", at, at, f"{t.device}/breaker", {"reason": t.reason}))

    log = BreakerLog(listener=tell)
    breakers = [Breaker(label, settings, log) for label in labels]
    extras = replace(extras, progress=progress, trace_marks=marks)
    restarts: list[dict[str, Any]] = []
    faulted: set[int] = set()  # devices that failed since they last ran
    while True:
        live = [i for i, b in enumerate(breakers) if b.available()]
        for i in faulted.intersection(live):  # NOTE: with fresh streams: an error on a stream is sticky
            devices[i] = devices[i].renew()
            faulted.discard(i)
        if not live:
            raise DevicesFailed({f"device@{b.device}": b.last_error for b in breakers}, RuntimeError(log.transitions))
        try:
            report = run_once(config, [devices[i] for i in live], extras)
        except StageError as exc:
            # NOTE: a run on fewer devices numbers them anew
            fault = device_fault(exc, device_labels([labels[i] for i in live]))
            if fault is None:
                raise  # a user's problem, or a stage that is not a device's
            failed, error = live[fault.device], fault.error
            if fault.hung:
                breakers[failed].trip(error)  # NOTE: a hung device is out at once
            else:
                breakers[failed].failure(error)
            faulted.add(failed)
            restarts.append({"device": labels[failed], "error": error, "committed_rows": _committed_rows(config)})
            # NOTE: from here the output is this run's own: resume it, never overwrite it
            config = replace(config, output=replace(config.output, resume=True, overwrite=False))
            continue
        for i in live:
            breakers[i].success()  # NOTE: a device on trial that saw the run through is back
        report.device_faults = [asdict(t) for t in log.transitions]
        report.restarts = restarts
        return report


def _committed_rows(config: RunConfig) -> int:
    """Rows the output's committed windows hold (its manifest), 0 before the first commit."""
    manifest = Path(f"{config.output.path}.parts") / "manifest.json"
    try:
        return sum(w["rows"] for w in json.loads(manifest.read_text())["windows"])
    except (OSError, ValueError, KeyError):
        return 0


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
