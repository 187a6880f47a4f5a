"""Inputs nobody on the project wrote: odd text encodings, odd ids, odd bytes. No row is lost unseen."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcinfer.errors import InputError
from hpcinfer.job.accounting import AccountingError, settle

from ..conftest import make_texts, run_job, small_config, write_jsonl


def _rejects(out: Path) -> list[dict]:
    path = Path(f"{out}.rejects.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _embeddings(table: pa.Table) -> np.ndarray:
    return np.asarray(table.column("embedding").to_pylist(), dtype=np.float32).reshape(table.num_rows, -1)


@pytest.mark.parametrize("encoding", ["dictionary", "string_view", "large_string"])
def test_parquet_text_stored_as_dictionary_or_view_is_text(tmp_path, tiny_model, encoding):
    texts = make_texts(90, seed=4)
    plain = pa.table({"id": [f"r{i}" for i in range(90)], "text": texts})
    column = {
        "dictionary": pa.array(texts).dictionary_encode(),  # what pandas 'category' columns become
        "string_view": pa.array(texts, pa.string_view()),
        "large_string": pa.array(texts, pa.large_string()),
    }[encoding]
    pq.write_table(plain, tmp_path / "plain.parquet")
    pq.write_table(plain.set_column(1, "text", column), tmp_path / "odd.parquet", row_group_size=40)
    assert pq.read_schema(tmp_path / "odd.parquet").field("text").type != pa.string()
    _, want = run_job(small_config(tmp_path / "plain.parquet", tmp_path / "plain-out.parquet", tiny_model))
    _, got = run_job(small_config(tmp_path / "odd.parquet", tmp_path / "odd-out.parquet", tiny_model))
    assert got.column("id").to_pylist() == want.column("id").to_pylist()
    assert np.array_equal(_embeddings(got), _embeddings(want))


def test_a_parquet_id_column_of_floats_is_refused_up_front(tmp_path, tiny_model):
    pq.write_table(pa.table({"id": [1.0, 2.0], "text": ["a", "b"]}), tmp_path / "f.parquet")
    with pytest.raises(InputError, match="id column 'id' holds double; ids must be strings or integers"):
        run_job(small_config(tmp_path / "f.parquet", tmp_path / "out.parquet", tiny_model))


def test_ids_that_are_not_strings_or_integers_are_rejects_with_their_own_reason(tmp_path, tiny_model):
    bad_ids = [["list"], {"an": "object"}, 1.5, True, "\ud800"]
    rows = [{"id": "ok-0", "text": "fine"}]
    rows += [{"id": bad, "text": f"text {k}"} for k, bad in enumerate(bad_ids)]
    rows += [{"id": 7, "text": "fine too"}]
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))  # ensure_ascii: "\ud800" stays escaped
    out = tmp_path / "out.parquet"
    report, table = run_job(small_config(src, out, tiny_model))
    assert table.column("id").to_pylist() == ["ok-0", "7"]  # a string and an integer: one text column
    rejects = _rejects(out)
    assert [r["reason"] for r in rejects] == ["invalid_id"] * len(bad_ids)
    assert [r["line"] for r in rejects] == [2, 3, 4, 5, 6]
    assert "an id must be a string or an integer" in rejects[0]["message"]
    assert report.accounting["rows_read"] == 7 and report.accounting["rows_rejected"] == 5


def test_a_null_id_never_collides_with_a_real_one(tmp_path, tiny_model):
    """Null ids used to take their row number as id, so a later row with that id was a 'duplicate'."""
    rows = [{"id": None, "text": "first"}, {"text": "no id at all"}, {"id": 0, "text": "zero"}]
    rows += [{"id": 1, "text": "one"}, {"id": None, "text": "another null"}, {"id": "0", "text": "dup of 0"}]
    out = tmp_path / "out.parquet"
    _, table = run_job(small_config(write_jsonl(tmp_path / "n.jsonl", rows), out, tiny_model))
    assert table.column("id").to_pylist() == [None, None, 0, 1, None]
    assert [(r["line"], r["reason"]) for r in _rejects(out)] == [(6, "duplicate_id")]  # "0" is 0


def test_a_lone_surrogate_in_text_is_a_reject_not_a_failed_run(tmp_path, tiny_model):
    src = tmp_path / "s.jsonl"
    src.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": "bad \\ud800 here"}\n{"id": "c", "text": "ok"}\n')
    out = tmp_path / "out.parquet"
    _, table = run_job(small_config(src, out, tiny_model))
    assert table.column("id").to_pylist() == ["a", "c"]
    assert [(r["id"], r["reason"], r["line"]) for r in _rejects(out)] == [("b", "invalid_unicode", 2)]


def test_a_byte_order_mark_does_not_spoil_the_first_row_when_a_chunk_is_parsed_line_by_line(tmp_path, tiny_model):
    # The malformed second line sends the chunk to the line-by-line parser, which met the BOM.
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"id": "first", "text": "hello"}\n{"id": broken\n{"id": "third", "text": "x"}\n')
    out = tmp_path / "out.parquet"
    _, table = run_job(small_config(src, out, tiny_model))
    assert table.column("id").to_pylist() == ["first", "third"]
    assert [(r["line"], r["reason"]) for r in _rejects(out)] == [(2, "malformed_json")]


def test_reject_locations_are_per_file_across_shards(tmp_path, tiny_model):
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(5)], "text": ["t"] * 5}), shards / "p0.parquet")
    pq.write_table(pa.table({"id": ["b0", "b1", "b2"], "text": ["t", " ", "t"]}), shards / "p1.parquet")
    write_jsonl(shards / "p2.jsonl", [{"id": "c0", "text": "t"}, {"id": "c1", "text": ""}])
    out = tmp_path / "out.parquet"
    run_job(small_config(shards, out, tiny_model))
    got = [(Path(r["source"]).name, r["row"], r["row_in_file"], r.get("line")) for r in _rejects(out)]
    assert got == [("p1.parquet", 6, 1, None), ("p2.jsonl", 9, 1, 2)]


def test_files_with_and_without_an_id_column_cannot_be_mixed(tmp_path, tiny_model):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "text": "t"}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "t"}])
    with pytest.raises(InputError, match="has no id column 'id' but .*a.jsonl has one"):
        run_job(small_config([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "o.parquet", tiny_model))


def test_books_that_do_not_balance_fail_naming_the_file():
    settled = settle([("a.jsonl", 10, 2)], {"a.jsonl": 7}, {"a.jsonl": 1})
    assert settled["balanced"] and settled["rows_read"] == 10
    with pytest.raises(AccountingError, match=r"b.jsonl: rows do not add up: 21 read, but 10 written \+ 0 rejected"):
        settle([("a.jsonl", 3, 0), ("b.jsonl", 21, 0)], {"a.jsonl": 3, "b.jsonl": 10}, {})


def test_a_row_lost_inside_the_pipeline_fails_the_run(tmp_path, tiny_model, monkeypatch):
    """The invariant catches what no single stage's test would: here the planner drops one row."""
    from hpcinfer.pipeline.plan import Planner

    real = Planner.process

    def lossy(self, block):  # noqa: ANN001, ANN202
        if block.block_id == 1 and len(block):
            first_tokens = int(block.lengths[0])
            block.ids, block.rows, block.lengths = block.ids[1:], block.rows[1:], block.lengths[1:]
            block.flat_ids = block.flat_ids[first_tokens:]
        return real(self, block)

    monkeypatch.setattr(Planner, "process", lossy)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(120))])
    out = tmp_path / "out.parquet"
    with pytest.raises(AccountingError, match="in.jsonl: rows do not add up: 120 read, but 119 written"):
        run_job(small_config(src, out, tiny_model))
    assert not out.exists()


# -- fuzzing: real values, not templates -----------------------------------------------------------

ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)  # surrogates and controls included
IDS = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 12),  # small ones, so that repeats happen
    st.text(st.characters(exclude_categories=("Cs",)), max_size=6),
    st.sampled_from(["3", "7", ""]),
    st.just([1]),
    st.just(2.5),
)


def _expected(rows: list[dict]) -> tuple[list[int], dict[int, str]]:
    """Which rows survive (input positions) and the reason of every other one, decided independently."""
    seen: set[str] = set()
    survivors, reasons = [], {}
    for k, row in enumerate(rows):
        text, row_id = row["text"], row["id"]
        if not text or text.isspace():
            reasons[k] = "empty_text"
        elif any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
            reasons[k] = "invalid_unicode"
        elif not _valid_id(row_id):
            reasons[k] = "invalid_id"
        elif row_id is not None and str(row_id) in seen:
            reasons[k] = "duplicate_id"
        else:
            if row_id is not None:
                seen.add(str(row_id))
            survivors.append(k)
    return survivors, reasons


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.fixed_dictionaries({"id": IDS, "text": ANY_TEXT}), min_size=1, max_size=40),
    ascii_only=st.booleans(),
    window=st.integers(3, 11),
)
def test_fuzzed_texts_and_ids_every_row_written_or_rejected(tmp_path_factory, tiny_model, rows, ascii_only, window):
    tmp = tmp_path_factory.mktemp("fuzz")
    rows = [{"id": "anchor", "text": "a row with text"}, *rows]  # the file must show its text column
    src = tmp / "in.jsonl"
    with open(src, "w", encoding="utf-8", errors="surrogatepass") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=ascii_only or _has_surrogate(row)) + "\n")
    out = tmp / "out.parquet"
    over = {"input": {"read_block_rows": 4, "read_chunk_bytes": 97}, "plan": {"sort_window": window}}
    report, table = run_job(small_config(src, out, tiny_model, **over))
    survivors, reasons = _expected(rows)
    text_of = [None if i is None else str(i) for i in table.column("id").to_pylist()]
    assert text_of == [None if rows[k]["id"] is None else str(rows[k]["id"]) for k in survivors]
    assert {r["row"]: r["reason"] for r in _rejects(out)} == reasons
    assert report.accounting["rows_read"] == len(rows) == report.rows + sum(report.rejects.values())
    # Every surviving row's embedding equals a run over the clean rows alone.
    clean = write_jsonl(
        tmp / "clean.jsonl", [{"id": f"c{n}", "text": rows[k]["text"]} for n, k in enumerate(survivors)]
    )
    _, want = run_job(small_config(clean, tmp / "clean.parquet", tiny_model))
    assert np.allclose(_embeddings(table), _embeddings(want), atol=1e-5)


def _valid_id(row_id: object) -> bool:
    if isinstance(row_id, str):
        return not any(0xD800 <= ord(ch) <= 0xDFFF for ch in row_id)
    return row_id is None or (isinstance(row_id, int) and not isinstance(row_id, bool))


def _has_surrogate(row: dict) -> bool:
    return any(isinstance(v, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in v) for v in row.values())
