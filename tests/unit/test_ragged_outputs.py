"""A head's ragged items (`values.Ragged`: NER's token labels, SPLADE's entries, token embeddings)
from the head to the output: row selection and Arrow round trips against plain Python lists, and
the three ragged tasks on the simulated asynchronous device (copies late, host buffers scribbled
on reuse, an out-of-memory split) writing exactly what the CPU device writes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcinfer.device.base import DeviceOutOfMemory
from hpcinfer.device.simulated import SimulatedDevice
from hpcinfer.pipeline.write import RaggedRows, Writer
from hpcinfer.values import Ragged, RaggedField, RaggedSpec

from ..conftest import make_texts, run_job, small_config, write_jsonl
from .test_ner import build_token_classifier
from .test_sparse import build_splade

SPEC = RaggedSpec((RaggedField("id", "int32"), RaggedField("vector", "float32", (3,))), max_items=6)


def _ragged(rows: list[list[int]]) -> Ragged:
    """Row r's items are its ints; each item's vector is (item, item + 0.5, -item)."""
    flat = np.array([i for row in rows for i in row], np.int32)
    vectors = np.stack([flat, flat + 0.5, -flat], axis=1).astype(np.float32).reshape(-1, 3)
    return Ragged(np.array([len(r) for r in rows], np.int64), {"id": flat, "vector": vectors})


def _lists(values: Ragged) -> list[list[int]]:
    ends = values.offsets()
    return [values.fields["id"][a:b].tolist() for a, b in zip(ends[:-1], ends[1:], strict=True)]


ROWS = st.lists(st.lists(st.integers(0, 1000), max_size=6), max_size=12)


@settings(max_examples=60, deadline=None)
@given(rows=ROWS, data=st.data())
def test_selected_rows_are_the_lists_selected(rows, data):
    values = _ragged(rows)
    picked = data.draw(st.lists(st.integers(0, max(0, len(rows) - 1)), max_size=len(rows))) if rows else []
    assert _lists(values[np.array(picked, np.int64)]) == [rows[i] for i in picked]
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows))), bool)
    chosen = values[mask]
    assert _lists(chosen) == [r for r, keep in zip(rows, mask, strict=True) if keep]
    assert np.array_equal(chosen.fields["vector"][:, 1], chosen.fields["id"] + 0.5)


@settings(max_examples=60, deadline=None)
@given(first=ROWS, second=ROWS)
def test_arrow_columns_round_trip_and_concat(first, second):
    values = Ragged.concat([_ragged(first), _ragged(second)])
    assert _lists(values) == first + second
    columns = values.columns()
    assert columns["id"].to_pylist() == first + second
    assert columns["vector"].type == pa.list_(pa.list_(pa.float32(), 3))
    table = pa.table(columns)  # NOTE: as a checkpoint chunk comes back: a table's chunked columns
    back = Ragged.from_columns({name: table.column(name) for name in columns}, SPEC)
    assert _lists(back) == first + second
    assert np.array_equal(back.fields["vector"], values.fields["vector"])
    assert SPEC.row_bytes == 6 * (4 + 3 * 4) and len(SPEC.empty(4)) == 4 and SPEC.empty(4).items == 0


@settings(max_examples=60, deadline=None)
@given(rows=ROWS.filter(bool), data=st.data())
def test_a_windows_batches_are_gathered_by_window_row(rows, data):
    """Batches land in any order, each holding any rows of the window; what is taken is by window row."""
    order = data.draw(st.permutations(range(len(rows))))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(rows) - 1)), max_size=3)))
    window = RaggedRows(len(rows), SPEC)
    for batch in np.split(np.array(order, np.int64), cuts):
        window.put(batch, _ragged([rows[i] for i in batch]))
    wanted = np.array(data.draw(st.permutations(range(len(rows)))), np.int64)[: data.draw(st.integers(0, len(rows)))]
    taken = window.take(wanted)
    assert _lists(taken) == [rows[i] for i in wanted]
    assert np.array_equal(taken.fields["vector"][:, 2], -taken.fields["id"].astype(np.float32))


class OomOnce(SimulatedDevice):
    """The simulated device, whose allocator fails the first forward (the batch is split in two)."""

    def __init__(self, **kw) -> None:  # noqa: ANN003
        super().__init__(**kw)
        self.failed = 0

    def before_forward(self, rows: int, width: int) -> None:
        if not self.failed and rows > 1:
            self.failed += 1
            raise DeviceOutOfMemory(f"injected: {rows} x {width}")


@pytest.fixture(scope="module")
def ragged_runs(tmp_path_factory):  # noqa: ANN201
    """kind -> (model, extra config) of each task whose rows are ragged items."""
    folder = tmp_path_factory.mktemp("ragged")
    return {
        "ner": (build_token_classifier(folder / "ner"), {}),
        "sparse": (build_splade(folder / "splade", seed=2), {}),
        "sparse top-k": (build_splade(folder / "splade-k", seed=3), {"sparse": {"max_active_dims": 7}}),
        "token embeddings": (None, {"embed": {"output_value": "token_embeddings"}}),
    }


@pytest.mark.parametrize("kind", ["ner", "sparse", "sparse top-k", "token embeddings"])
def test_the_simulated_async_device_writes_what_the_cpu_writes(tmp_path, tiny_model, ragged_runs, kind):
    model, over = ragged_runs[kind]
    model = model or tiny_model
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(150, seed=4))])
    _, cpu = run_job(small_config(src, tmp_path / "cpu.parquet", model, **over))
    device = OomOnce(streams=2, seed=1)
    try:
        cfg = small_config(src, tmp_path / "sim.parquet", model, device={"staging_buffers": 2, "streams": 2}, **over)
        report, simulated = run_job(cfg, device=device)
    finally:
        device.close()
    assert device.failed == 1 and report.oom_splits >= 1
    assert simulated.equals(cpu)
    assert cpu.num_rows == 150 and report.windows == 2


def test_items_read_before_their_copy_is_done_are_caught(tmp_path, tiny_model, monkeypatch):
    """A writer that does not wait for d2h_done reads an arena scribbled over, or not yet written."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(150, seed=4))])
    tokens = {"embed": {"output_value": "token_embeddings"}}
    _, cpu = run_job(small_config(src, tmp_path / "cpu.parquet", tiny_model, **tokens))
    monkeypatch.setattr(Writer, "wait_result", staticmethod(lambda pending: None))
    device = SimulatedDevice(streams=2, seed=5, max_delay_s=0.02)
    try:
        cfg = small_config(src, tmp_path / "sim.parquet", tiny_model, device={"staging_buffers": 2, "streams": 2},
                           **tokens)  # fmt: skip
        try:
            _, simulated = run_job(cfg, device=device)
        except Exception:  # noqa: BLE001  NOTE: reading a half-written arena may also fail outright
            return
    finally:
        device.close()
    assert not simulated.equals(cpu)
