"""A run report as JSON (--report): its fields, the schema version, and the figures derived from them."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

SCHEMA_VERSION = 1


class JsonReport:
    """Mixed into each task's report dataclass; the task names the derived figures it adds, with
    the digits each is rounded to (`DERIVED`)."""

    __slots__ = ()
    DERIVED: tuple[tuple[str, int], ...] = ()

    def derived(self) -> dict[str, Any]:
        return {name: round(getattr(self, name), digits) for name, digits in self.DERIVED}

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self), **self.derived()}  # type: ignore[call-overload]

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, default=str)
            fh.write("\n")


def ratio(part: float, whole: float, empty: float = 0.0) -> float:
    """part / whole, or `empty` when there is no whole (a run of no rows, no time)."""
    return part / whole if whole else empty
