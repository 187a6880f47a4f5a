"""Every input row accounted for: rows read = rows written + rows rejected + rows resumed, per file.

The reader counts the rows it takes from each file; the writer counts the rows this run computed
and wrote, the reject counter the rows it set aside; resumed are the rows an interrupted run had
finished: those of its committed windows (written or rejected then), and those its checkpoints
hold (taken back, not run again; written into this run's parts, but not by this run). A run whose
books do not balance fails naming the file: a lost row is never a success.

Every task reports the same three numbers in its table, its accounting line and its JSON: `rows`
(written by this run) is `accounting.rows_written`, `rows_resumed` is `accounting.rows_resumed`.

What every task's run shows live of its output (obs/meter.py, `watch_output`) is these books as
they fill: rows by what became of them, windows committed, and a mark on the timeline at each commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import HpcinferError
from ..obs.meter import COUNTER, Meter


class AccountingError(HpcinferError):
    """Rows went missing (or appeared) between reading and writing: a defect, reported as such."""

    exit_code = 4


@dataclass(frozen=True, slots=True)
class FileAccount:
    path: str
    read: int
    written: int
    rejected: int
    resumed: int

    @property
    def balanced(self) -> bool:
        return self.read == self.written + self.rejected + self.resumed


def settle(read: Iterable[tuple[str, int, int]], written: dict[str, int], rejected: dict[str, int]) -> dict[str, Any]:
    """(path, rows read, rows resumed) per file -> the report's `accounting`; raises if a file does not balance."""
    files = [FileAccount(p, n, written.get(p, 0), rejected.get(p, 0), resumed) for p, n, resumed in read]
    unknown = (set(written) | set(rejected)) - {f.path for f in files}
    if unknown:
        raise AccountingError(f"rows were written or rejected for a file never read: {sorted(unknown)[0]}")
    for f in files:
        if not f.balanced:
            raise AccountingError(
                f"rows do not add up: {f.read:,} read, but {f.written:,} written + {f.rejected:,} rejected "
                f"+ {f.resumed:,} resumed = {f.written + f.rejected + f.resumed:,}",
                path=f.path,
            )
    total = {key: sum(getattr(f, key) for f in files) for key in ("read", "written", "rejected", "resumed")}
    return {
        "rows_read": total["read"],
        "rows_written": total["written"],
        "rows_rejected": total["rejected"],
        "rows_resumed": total["resumed"],
        "balanced": True,
        "files": [asdict(f) for f in files],
    }


def books(report: Any) -> None:
    """The report's `rows` and `rows_resumed` as its accounting has them (one set of books)."""
    if report.accounting:
        report.rows = report.accounting["rows_written"]
        report.rows_resumed = report.accounting["rows_resumed"]


def accounting_line(accounting: dict[str, Any]) -> str:
    a = accounting
    return (
        f"{a['rows_read']:,} read = {a['rows_written']:,} written + {a['rows_rejected']:,} rejected"
        f" + {a['rows_resumed']:,} resumed"
    )


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
