"""What every task's run shows live of its output (obs/meter.py): rows by what became of them,
windows committed, and a mark on the timeline at each commit."""

from __future__ import annotations

from typing import Any

from ..obs.meter import COUNTER, Meter


def watch_output(meter: Meter, store: Any, rejects: Any, resumed: int) -> None:
    """`store`: the output's store (rows_written, windows); `rejects`: the run's RejectCounter;
    `resumed`: the rows the report counts as resumed (committed, or held by checkpoints, before
    this run). Rows done + resumed are the report's rows once the run ends. Watched again (a run
    restarted on fewer devices), the rows resumed stay those before the first start."""
    resumed = meter.facts.setdefault("rows_resumed", resumed)
    meter.probe("rows.done", lambda: max(0, store.rows_written - resumed), COUNTER)
    meter.probe("rows.resumed", lambda: resumed, COUNTER)
    if hasattr(store, "windows"):
        # NOTE: from the committed windows, not the run's reject counter: a run restarted on fewer
        # devices counts its rejects anew, and its redone windows' rejects again
        before = meter.facts.setdefault("rejects_resumed", sum(w.get("rejects", 0) for w in store.windows))
        meter.probe("rows.rejected", lambda: sum(w.get("rejects", 0) for w in store.windows) - before, COUNTER)
        meter.probe("windows", lambda: len(store.windows), COUNTER)
    else:
        meter.probe("rows.rejected", lambda: rejects.total, COUNTER)
    if hasattr(store, "on_commit"):
        store.on_commit = lambda entry: meter.event("commit", window=entry["window"], rows=entry["rows"])
