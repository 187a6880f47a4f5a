"""One set of books for every task: a run interrupted after some windows were committed and some rows
checkpointed, then resumed, says the same thing of its rows in its table, its accounting line and
its JSON: rows written by this run, rows resumed (the committed windows' input rows and the rows
the checkpoints held, taken back, never counted as written), rows rejected; read = their sum."""

from __future__ import annotations

import io
import json
import re
import threading
from dataclasses import asdict, replace

import pytest
from rich.console import Console

from hpcinfer.api import run
from hpcinfer.errors import Interrupted, StageError
from hpcinfer.obs.progress import Progress
from tests.fixtures.tiny_classifier import build_tiny_classifier
from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import generate_config, make_texts, small_config, write_jsonl
from .test_ner import build_token_classifier
from .test_sparse import build_splade

ROWS = 150  # windows of 30 rows: 5 windows, a bad row in the first


def _rendered(report) -> str:  # noqa: ANN001
    out = io.StringIO()
    report.render(Console(file=out, width=200, color_system=None))
    return out.getvalue()


def _table_number(text: str, label: str) -> int:
    found = re.search(rf"{label}[\s│|]+([\d,]+)", text)
    return int(found.group(1).replace(",", "")) if found else 0


def assert_the_books_agree(report, read: int) -> None:  # noqa: ANN001
    """The JSON, the accounting and the table say the same of the run's rows."""
    data = json.loads(json.dumps(asdict(report), default=str))
    books = data["accounting"]
    assert books["balanced"] and books["rows_read"] == read
    assert data["rows"] == books["rows_written"] and data["rows_resumed"] == books["rows_resumed"]
    assert books["rows_written"] + books["rows_rejected"] + books["rows_resumed"] == read
    text = _rendered(report)
    assert _table_number(text, "rows written") == books["rows_written"]
    assert _table_number(text, "rows resumed") == books["rows_resumed"]
    line = f"{read:,} read = {books['rows_written']:,} written + {books['rows_rejected']:,} rejected + "
    assert line + f"{books['rows_resumed']:,} resumed" in text


def _rows(pairs: bool = False) -> list[dict]:
    texts = make_texts(ROWS, seed=9)
    rows = [{"id": i, "text": t} for i, t in enumerate(texts)]
    if pairs:
        rows = [{"id": i, "query": t, "doc": texts[-1 - i]} for i, t in enumerate(texts)]
    rows[4] = {"id": 4}  # no text: a reject of the first window, which the resumed run does not see again
    return rows


@pytest.fixture(scope="module")
def models(tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("books")
    return {
        "classify": build_tiny_classifier(folder / "classify", "bert"),
        "score": build_tiny_classifier(folder / "score", "bert", labels=("relevance",)),
        "ner": build_token_classifier(folder / "ner"),
        "sparse": build_splade(folder / "splade", seed=1),
    }


@pytest.mark.parametrize("task", ["embed", "classify", "score", "ner", "sparse"])
def test_a_resumed_pooling_run_keeps_one_set_of_books(tmp_path, tiny_model, models, task):
    model = models.get(task, tiny_model)
    src = write_jsonl(tmp_path / "in.jsonl", _rows(pairs=task == "score"))
    over = {"plan": {"sort_window": 30}, "output": {"commit_every": 1e-9}}  # NOTE: a checkpoint after every batch
    if task == "score":
        over["input"] = {"pair_columns": ("query", "doc")}
    cfg = small_config(src, tmp_path / "out.parquet", model, **over)
    landed = {"n": 0}

    def fail_in_the_fourth_window(pending) -> None:  # noqa: ANN001
        if pending.batch.window.window_id == 3:
            landed["n"] += 1
            if landed["n"] == 3:  # NOTE: after two of its batches landed (and were checkpointed)
                raise RuntimeError("injected fault")

    with pytest.raises(StageError):
        run(cfg, progress=Progress("off"), hooks={"write": fail_in_the_fourth_window})
    resumed = run(replace(cfg, output=replace(cfg.output, resume=True)), progress=Progress("off"))
    assert_the_books_agree(resumed, ROWS)
    # NOTE: 3 windows committed (90 input rows, the reject among them) and the checkpointed rows
    assert resumed.accounting["rows_resumed"] > 90 and resumed.accounting["rows_rejected"] == 0
    whole_cfg = replace(cfg, output=replace(cfg.output, path=str(tmp_path / "whole.parquet")))
    whole = run(whole_cfg, progress=Progress("off"))
    assert_the_books_agree(whole, ROWS)
    assert whole.accounting["rows_resumed"] == 0 and whole.accounting["rows_rejected"] == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_a_resumed_generation_keeps_one_set_of_books(tmp_path):
    model = build_tiny_decoder(tmp_path / "llama", "LlamaForCausalLM", seed=3, max_positions=128)
    rows = [{"id": i, "prompt": t, "max_tokens": 4} for i, t in enumerate(make_texts(40, seed=2))]
    rows[2] = {"id": 2}
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = generate_config(src, tmp_path / "out.jsonl", model, device={"threads": 1}, window_rows=10, max_num_seqs=2)
    cfg = replace(cfg, output=replace(cfg.output, commit_every=1e-9))
    stop, steps = threading.Event(), {"n": 0}

    def stop_in_the_third_window() -> None:
        steps["n"] += 1
        if steps["n"] == 60:  # NOTE: two windows committed by then, some rows of the next checkpointed
            stop.set()

    from hpcinfer.tasks.generate.job import run_generate

    with pytest.raises(Interrupted) as stopped:
        run_generate(cfg, step_hooks={"cpu": stop_in_the_third_window}, stop=stop, progress=Progress("off"))
    assert "rows are committed" in str(stopped.value)
    resumed = run(replace(cfg, output=replace(cfg.output, resume=True)), progress=Progress("off"))
    assert_the_books_agree(resumed, 40)
    assert resumed.accounting["rows_resumed"] > 20 and resumed.accounting["rows_rejected"] == 0
