"""Bad rows become rejects with the right reason; every valid row is written once, in order."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcinfer.device.base import DeviceOutOfMemory
from hpcinfer.device.cpu import CpuDevice
from hpcinfer.errors import HpcinferError

from ..conftest import WORDS, make_texts, run_job, small_config, write_jsonl, write_parquet

LONG = " ".join(["tokens"] * 300)

# kind -> (raw JSONL line given an id, expected reason); None reason: a valid row
BAD_KINDS = {
    "malformed": (lambda i: b'{"id": "%s", "text": "unterminated' % i.encode(), "malformed_json"),
    "not_object": (lambda i: b"[1, 2, 3]", "malformed_json"),
    "missing_text": (lambda i: json.dumps({"id": i}).encode(), "missing_text"),
    "null_text": (lambda i: json.dumps({"id": i, "text": None}).encode(), "missing_text"),
    "number_text": (lambda i: json.dumps({"id": i, "text": 42}).encode(), "wrong_type"),
    "list_text": (lambda i: json.dumps({"id": i, "text": ["a"]}).encode(), "wrong_type"),
    "object_text": (lambda i: json.dumps({"id": i, "text": {"a": 1}}).encode(), "wrong_type"),
    "empty_text": (lambda i: json.dumps({"id": i, "text": ""}).encode(), "empty_text"),
    "blank_text": (lambda i: json.dumps({"id": i, "text": " \t\n "}).encode(), "empty_text"),
    "bad_utf8": (lambda i: b'{"id": "%s", "text": "caf\xe9 \xff"}' % i.encode(), "invalid_utf8"),
    "too_long": (lambda i: json.dumps({"id": i, "text": LONG}).encode(), "too_long"),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kinds=st.lists(st.sampled_from([None, None, None, *BAD_KINDS, "duplicate"]), min_size=1, max_size=60),
    words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
)
def test_fuzzed_jsonl_never_crashes_and_loses_nothing(tmp_path_factory, tiny_model, kinds, words):
    tmp = tmp_path_factory.mktemp("fuzz")
    # NOTE: a file in which no row has the text column at all is a whole-input error, not rejects.
    kinds = [None, *kinds]
    lines, expected_ok, expected_bad = [], [], {}
    seen_ok: list[str] = []
    for row, kind in enumerate(kinds):
        rid = f"id-{row}"
        if kind is None:
            lines.append(json.dumps({"id": rid, "text": " ".join(words[: row % len(words) + 1])}).encode())
            expected_ok.append(rid)
            seen_ok.append(rid)
        elif kind == "duplicate" and seen_ok:
            lines.append(json.dumps({"id": seen_ok[0], "text": "again"}).encode())
            expected_bad[row] = "duplicate_id"
        elif kind == "duplicate":
            lines.append(b"")  # a blank line is not a row
            continue
        else:
            make, reason = BAD_KINDS[kind]
            lines.append(make(rid))
            expected_bad[row] = reason
    src = tmp / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    bad_rows = {}
    r = 0
    for row, kind in enumerate(kinds):
        if kind == "duplicate" and row not in expected_bad:
            continue
        if row in expected_bad:
            bad_rows[r] = expected_bad[row]
        r += 1
    # Blank lines are not rows: number the expected rejects over the rows actually written.
    out = tmp / "out.parquet"
    cfg = small_config(src, out, tiny_model, tokenize={"on_long": "reject", "max_length": 64})
    report, table = run_job(cfg)
    assert table.column("id").to_pylist() == expected_ok
    rejects_file = tmp / "out.parquet.rejects.jsonl"
    got = [json.loads(line) for line in rejects_file.read_text().splitlines()] if rejects_file.exists() else []
    assert {g["row"]: g["reason"] for g in got} == bad_rows
    assert all(g["source"] == str(src) and g["message"] for g in got)
    assert report.rows + sum(report.rejects.values()) == r
    assert sum(report.rejects.values()) == len(bad_rows)


def test_pretokenized_out_of_vocabulary_and_negative_ids_are_rejected(tmp_path, tiny_model):
    rows = [
        {"id": "ok", "input_ids": [101, 2000, 102]},
        {"id": "neg", "input_ids": [101, -5, 102]},
        {"id": "oov", "input_ids": [101, 999_999, 102]},
        {"id": "ok2", "input_ids": [101, 2001, 2002, 102]},
    ]
    src = write_parquet(tmp_path / "tok.parquet", rows)
    report, table = run_job(small_config(src, tmp_path / "out.parquet", tiny_model))
    assert table.column("id").to_pylist() == ["ok", "ok2"]
    got = [json.loads(x) for x in (tmp_path / "out.parquet.rejects.jsonl").read_text().splitlines()]
    assert [(g["id"], g["reason"], g["row"]) for g in got] == [
        ("neg", "invalid_token_ids", 1),
        ("oov", "invalid_token_ids", 2),
    ]
    assert report.rejects == {"invalid_token_ids": 2}


def test_parquet_null_and_empty_texts_are_rejected(tmp_path, tiny_model):
    rows = [{"id": 1, "text": "fine"}, {"id": 2, "text": None}, {"id": 3, "text": "  "}, {"id": 4, "text": "ok"}]
    src = write_parquet(tmp_path / "in.parquet", rows)
    report, table = run_job(small_config(src, tmp_path / "out.parquet", tiny_model))
    assert table.column("id").to_pylist() == [1, 4]
    assert report.rejects == {"empty_text": 1, "missing_text": 1}


def test_strict_and_max_rejects_abort_cleanly(tmp_path, tiny_model):
    rows = [{"id": i, "text": "" if i % 10 == 3 else "text"} for i in range(100)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    strict = small_config(src, out, tiny_model, output={"max_rejects": 0})
    with pytest.raises(HpcinferError, match=r"rejected \(--strict\).*row 3: empty_text"):
        run_job(strict)
    assert not out.exists()
    loose = small_config(src, out, tiny_model, output={"max_rejects": 20})
    report, table = run_job(loose)
    assert table.num_rows == 90 and report.rejects == {"empty_text": 10}
    fraction = small_config(src, tmp_path / "f.parquet", tiny_model, output={"max_reject_fraction": 0.05})
    with pytest.raises(HpcinferError, match="of input rows rejected"):
        run_job(fraction)


class OomAbove(CpuDevice):
    """A CPU device whose allocator 'fails' for forwards above a token count."""

    def __init__(self, limit_tokens: int, always_fail_width: int | None = None) -> None:
        super().__init__()
        self.limit = limit_tokens
        self.always_fail_width = always_fail_width
        self.failures = 0

    def before_forward(self, rows: int, width: int) -> None:
        if rows * width > self.limit or width == self.always_fail_width:
            self.failures += 1
            raise DeviceOutOfMemory(f"injected: {rows} x {width}")


def test_out_of_memory_splits_batches_and_gives_identical_output(tmp_path, tiny_model, requests_jsonl):
    clean_report, clean = run_job(small_config(requests_jsonl, tmp_path / "clean.parquet", tiny_model))
    device = OomAbove(limit_tokens=200)
    report, table = run_job(small_config(requests_jsonl, tmp_path / "oom.parquet", tiny_model), device=device)
    assert table.column("id").to_pylist() == clean.column("id").to_pylist()
    emb, ref = (np.asarray(t.column("embedding").to_pylist()) for t in (table, clean))
    np.testing.assert_allclose(emb, ref, rtol=1e-5, atol=1e-6)
    assert report.oom_splits > 0 and device.failures > 0
    assert report.final_max_batch_tokens < 1024  # the running budget came down
    assert report.rejects == {}


def test_a_row_that_never_fits_becomes_an_oom_reject(tmp_path, tiny_model):
    texts = make_texts(40, seed=2) + [" ".join(["long"] * 200)]  # 202 tokens: the only row padded to 208
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    cfg = small_config(src, tmp_path / "out.parquet", tiny_model)
    report, table = run_job(cfg, device=OomAbove(limit_tokens=10_000, always_fail_width=208))
    assert 40 not in table.column("id").to_pylist() and table.num_rows == 40
    got = [json.loads(x) for x in (tmp_path / "out.parquet.rejects.jsonl").read_text().splitlines()]
    assert [(g["id"], g["reason"]) for g in got] == [(40, "oom")]


def test_a_full_disk_is_a_clear_error_and_leaves_no_output(tmp_path, tiny_model, requests_jsonl, monkeypatch):
    import errno

    import hpcinfer.files.parts

    def no_space(*_args, **_kwargs):  # noqa: ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hpcinfer.files.parts.pq, "write_table", no_space)
    out = tmp_path / "out.parquet"
    with pytest.raises(HpcinferError, match="No space left on device"):
        run_job(small_config(requests_jsonl, out, tiny_model))
    assert not out.exists()
    assert not list((tmp_path).glob("**/.part-*.tmp-*"))


def test_the_seen_id_set_answers_the_same_across_bulk_merges(monkeypatch):
    from hpcinfer.pipeline.read import IdSet, id_key

    monkeypatch.setattr(IdSet, "_MERGE_AT", 7)
    seen, keys = IdSet(), [id_key(v) for v in [*range(300), *(f"s{i}" for i in range(300)), -1, 2**62]]
    for i, key in enumerate(keys):
        assert key not in seen
        seen.add(key)
        assert all(k in seen for k in keys[: i + 1 : 37])
    assert all(k in seen for k in keys)
