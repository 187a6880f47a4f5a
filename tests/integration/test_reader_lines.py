"""JSONL lines of every length around the reader's chunk size: each line is a row or a reject, in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcinfer.config import InputConfig
from hpcinfer.files.lines import BOM
from hpcinfer.pipeline.read import Reader

CHUNK = 64  # the reader's chunk size in these tests: lines are drawn around it

# A line: ("row", total length in bytes) | ("blank", spaces) | ("bad", length): malformed JSON
LINE = st.one_of(
    st.tuples(
        st.just("row"),
        st.one_of(
            st.integers(CHUNK - 3, CHUNK + 3),  # just below, at and above a chunk
            st.integers(2 * CHUNK - 2, 2 * CHUNK + 2),
            st.integers(24, 5 * CHUNK),  # several chunks long
            st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1]),
        ),
    ),
    st.tuples(st.just("blank"), st.integers(0, 3)),
    st.tuples(st.just("bad"), st.integers(1, 3 * CHUNK)),
)


def _row_line(row_id: int, length: int) -> bytes:
    empty = json.dumps({"id": row_id, "text": ""})
    return json.dumps({"id": row_id, "text": "x" * max(1, length - len(empty))}).encode()


def _read_all(path: Path, chunk_bytes: int = CHUNK) -> tuple[list, list, Reader]:
    """(ids of the valid rows, rejects, the reader), read in small blocks and windows."""
    cfg = InputConfig((str(path),), read_block_rows=7, read_chunk_bytes=chunk_bytes)
    reader = Reader(cfg, window_rows=5)
    events, rejects = [], []  # (global row, what it became)
    for block in reader.produce():
        events += [(row, ("row", row_id)) for row, row_id in zip(block.rows, block.ids, strict=True)]
        events += [(r.row, ("reject", r.line)) for r in block.rejects]
        rejects += block.rejects
    return [what for _, what in sorted(events)], rejects, reader


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(LINE, min_size=0, max_size=40),
    final_newline=st.booleans(),
    crlf=st.booleans(),
    bom=st.booleans(),
)
def test_every_line_is_a_row_or_a_reject_in_order(tmp_path_factory, lines, final_newline, crlf, bom):
    end = b"\r\n" if crlf else b"\n"
    raw, expected = [], []  # expected: ("row", id) or ("reject", line number), in order
    for number, (kind, size) in enumerate(lines, start=1):
        if kind == "row":
            raw.append(_row_line(number, size))
            expected.append(("row", number))
        elif kind == "blank":
            raw.append(b" " * size)
        else:
            raw.append(b'{"id": %d, "text": "' % number + b"y" * size)  # never closed
            expected.append(("reject", number))
    data = end.join(raw) + (end if final_newline and raw else b"")
    path = tmp_path_factory.mktemp("lines") / "in.jsonl"
    path.write_bytes((BOM if bom else b"") + data)
    became, rejects, reader = _read_all(path)
    assert became == expected
    assert all(r.reason == "malformed_json" for r in rejects)
    count = reader.counts[str(path)]
    assert count.read == len(expected) == reader.rows_read


def test_a_line_of_five_megabytes_between_short_ones(tmp_path):
    """The reported loss: a 5 MB line used to end the read silently after 10 of 21 rows."""
    rows = [{"id": i, "text": f"row {i} measures latency"} for i in range(21)]
    rows[10]["text"] = "word " * (1 << 20)
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert src.stat().st_size > 5 * (1 << 20)
    became, rejects, reader = _read_all(src, chunk_bytes=1 << 20)  # the default chunk
    assert became == [("row", i) for i in range(21)] and not rejects
    assert reader.counts[str(src)].read == 21


def test_the_cli_writes_every_row_of_the_long_line_file_and_prints_the_accounting(tmp_path, tiny_model):
    rows = [{"id": i, "text": f"row {i} measures latency"} for i in range(21)]
    rows[10]["text"] = "word " * (1 << 20)
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(out), "--model", str(tiny_model)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    import pyarrow.parquet as pq

    assert pq.read_table(out).column("id").to_pylist() == list(range(21))
    assert "21 read = 21 written + 0 rejected + 0 resumed" in done.stderr
    assert not Path(f"{out}.rejects.jsonl").exists()
