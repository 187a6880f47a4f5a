"""Rejected rows: counted by reason and by file, and the limits of --max-rejects and --strict."""

from __future__ import annotations

import threading

from ..errors import HpcinferError
from ..types import Reject


class RejectLimitExceeded(HpcinferError):
    exit_code = 3


class RejectCounter:
    """Counts rejects by reason; enforces --max-rejects (a count, or a fraction of input rows)."""

    def __init__(self, max_count: int | None = None, max_fraction: float | None = None) -> None:
        self.max_count = max_count
        self.max_fraction = max_fraction
        self.by_reason: dict[str, int] = {}
        self.by_source: dict[str, int] = {}
        self.total = 0
        self._lock = threading.Lock()

    def add(self, rejects: list[Reject]) -> None:
        with self._lock:
            before = self.total
            for r in rejects:
                self.by_reason[r.reason] = self.by_reason.get(r.reason, 0) + 1
                self.by_source[r.source] = self.by_source.get(r.source, 0) + 1
            self.total += len(rejects)
        if self.max_count is not None and self.total > self.max_count:
            what = "a row was rejected (--strict)" if self.max_count == 0 else f"more than {self.max_count} rejected"
            self._fail(what, rejects[max(self.max_count - before, 0)])  # the row that crossed the limit

    def check_fraction(self, input_rows: int) -> None:
        limit = self.max_fraction
        if limit is not None and input_rows and self.total / input_rows > limit:
            self._fail(f"{self.total / input_rows:.1%} of input rows rejected (limit {limit:.1%})", None)

    def _fail(self, what: str, reject: Reject | None) -> None:
        detail = f"; row {reject.row}: {reject.reason}: {reject.message}" if reject else ""
        raise RejectLimitExceeded(f"stopping: {what}{detail}")
