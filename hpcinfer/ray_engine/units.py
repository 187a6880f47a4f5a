"""Work units of a cluster run: windows of global input rows, each located in its files.

The local engine's guarantees (order, exact resume, the same batches in every run) come from
windows of exactly `sort_window` global input rows. So the driver cuts the input into the very
same windows before anything runs: row counts per file are known up front (Parquet footers; a
JSONL file by one scan of its lines), and each window becomes a unit that names, per file it
touches, the first row in that file, how many rows, and for JSONL the byte offset and line number
of that row, so a replica reads only its own rows. No Ray and no torch here: plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InputError
from ..files import storage
from ..files.lines import BOM
from ..files.row_source import Segment
from ..files.sources import Source, parquet_rows


@dataclass(frozen=True, slots=True)
class Unit:
    """One window: global rows [first_row, first_row + input_rows), read from `segments` in order."""

    window_id: int
    first_row: int
    input_rows: int
    segments: tuple[Segment, ...] = field(default_factory=tuple)


def count_rows(src: Source, first_row: int = 0, window_rows: int = 0) -> tuple[int, dict[int, tuple[int, int]]]:
    """Rows of one file starting at global row `first_row`; for JSONL, where each window starts in it.

    The second value maps a row index within the file (0, and every row whose global number is a
    multiple of `window_rows`) to the (byte offset, line number) of its line. A JSONL row is a line
    that is not blank, exactly as `lines.LineSplitter` counts them (a byte order mark on line 1 is
    not part of it; a line of only `\\r` or spaces is blank).
    """
    if src.fmt == "parquet":
        try:
            return parquet_rows(src.path), {}
        except (*storage.errors(), ValueError) as exc:
            raise InputError(
                f"not a readable Parquet file ({storage.failure(exc)})", path=storage.shown(src.path)
            ) from None
    where: dict[int, tuple[int, int]] = {}
    rows = offset = 0
    try:
        with storage.open_binary(src.path, block_size=8 << 20) as fh:
            for line_no, raw in enumerate(fh, start=1):
                body = raw[len(BOM) :] if line_no == 1 and raw.startswith(BOM) else raw
                if body.strip():
                    if rows == 0 or (window_rows and (first_row + rows) % window_rows == 0):
                        where[rows] = (offset, line_no)
                    rows += 1
                offset += len(raw)
    except storage.errors() as exc:
        raise InputError(f"cannot read file ({storage.failure(exc)})", path=storage.shown(src.path)) from None
    return rows, where


def plan_units(sources: list[Source], window_rows: int, first_window: int = 0) -> tuple[list[Unit], dict[str, int]]:
    """The windows from `first_window` on, as units; and the rows of every file (each read once)."""
    totals: dict[str, int] = {}
    located: dict[str, dict[int, tuple[int, int]]] = {}
    total = 0
    for src in sources:
        totals[src.path], located[src.path] = count_rows(src, total, window_rows)
        total += totals[src.path]

    units = []
    for window in range(first_window, -(-total // window_rows)):
        lo, hi = window * window_rows, min(total, (window + 1) * window_rows)
        segments, file_first = [], 0
        for src in sources:
            n = totals[src.path]
            a, b = max(lo, file_first), min(hi, file_first + n)
            if a < b:
                offset, line = located[src.path].get(a - file_first, (0, 1))
                segments.append(Segment(src.path, file_first, a - file_first, b - a, offset, line))
            file_first += n
        units.append(Unit(window, lo, hi - lo, tuple(segments)))
    return units, totals
