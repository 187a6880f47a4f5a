"""The HTML report of real runs (the CLI, a tiny BERT and a tiny Llama) opened in headless Chromium
with the network off: no errors, every chart drawn with points, the figures shown equal to the JSON
report's; `hpcinfer report` makes the same page from the JSON; and a Prometheus endpoint scraped
while a run runs (parsed by prometheus_client's parser) counts up to the report's final figures."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.tiny_decoder import build_tiny_decoder

from ..conftest import make_texts, write_jsonl
from .browser import open_report

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
EMBED_CHARTS = {"rows_per_s", "tokens_per_s", "stage_busy", "device_rows", "token_share"}
GENERATE_CHARTS = {
    *("rows_per_s", "tokens_per_s", "step_busy", "sequences", "occupancy", "kv_blocks", "preemptions"),
    *("prefix_hits", "ttft", "tpot", "finish_reasons"),
}


def hpcinfer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "hpcinfer", *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def number(text: str) -> float:
    """'4,959.162 ms' -> 4959.162; '41.87%' -> 41.87."""
    match = re.search(r"-?[\d,]+(?:\.\d+)?", text)
    assert match, text
    return float(match.group(0).replace(",", ""))


def check_page(page: Path, report: dict[str, Any], charts: set[str], shot: Path) -> dict[str, Any]:
    seen = open_report(page, shot)
    assert seen["errors"] == []
    assert [u for u in seen["requests"] if not u.startswith("file:")] == []  # NOTE: nothing fetched
    assert charts <= set(seen["charts"]), charts - set(seen["charts"])
    for key, points in seen["charts"].items():  # NOTE: the first renderer is the chart's own series, not its marks
        assert points and points[0] > 0, f"chart {key} has no points: {points}"
    assert seen["charts"]["rows_per_s"][0] >= 2  # NOTE: a line over time, not a lone point (a fast run has few)
    f = seen["figures"]
    assert number(f["rows"]) == report["rows"]
    assert number(f["rows_rejected"]) == sum(report["rejects"].values())
    assert number(f["wall_s"]) == pytest.approx(report["wall_s"], abs=5e-4)
    a = report["accounting"]
    assert [number(x) for x in re.findall(r"[\d,]+ (?:read|written|rejected|resumed)", f["accounting"])] == [
        a["rows_read"], a["rows_written"], a["rows_rejected"], a["rows_resumed"],
    ]  # fmt: skip
    return f


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model) -> dict[str, Path]:
    """An embedding run on two CPU devices and a generation run, each with its JSON and HTML report."""
    root = tmp_path_factory.mktemp("reports")
    texts = make_texts(2000, seed=5)
    src = write_jsonl(root / "rows.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    hpcinfer(
        "run", str(src), "-o", str(root / "emb.parquet"), "--model", str(tiny_model), "--devices", "cpu,cpu",
        "--sort-window", "250", "--max-batch-tokens", "2048", "--report", str(root / "emb.json"),
        "--report-html", str(root / "emb.html"), "-q",
    )  # fmt: skip
    llama = build_tiny_decoder(root / "llama", "LlamaForCausalLM", seed=7)
    system = {"role": "system", "content": "You answer in one short sentence, as a careful librarian would."}
    chats = [{"id": f"c{i}", "messages": [system, {"role": "user", "content": t}]} for i, t in enumerate(texts[:100])]
    chats_src = write_jsonl(root / "chats.jsonl", chats)
    hpcinfer(
        "run", str(chats_src), "-o", str(root / "gen.jsonl"), "--model", str(llama), "--max-tokens", "24",
        "--max-num-seqs", "16", "--window-rows", "20", "--threads", "1", "--report", str(root / "gen.json"),
        "--report-html", str(root / "gen.html"), "-q",
    )  # fmt: skip
    return {"root": root, "emb": root / "emb", "gen": root / "gen"}


def test_the_embedding_report_draws_every_chart_with_the_reports_figures(runs):
    report = json.loads(runs["emb"].with_suffix(".json").read_text())
    f = check_page(runs["emb"].with_suffix(".html"), report, EMBED_CHARTS, runs["root"] / "emb.png")
    assert number(f["real_tokens"]) == report["real_tokens"]
    assert number(f["rows_per_s"]) == pytest.approx(report["rows_per_s"], abs=5e-4)
    assert number(f["batch_p50_ms"]) == pytest.approx(report["batch_latency_ms"]["p50"], abs=5e-4)
    assert report["rows"] == 2000 and len(report["timeline"]["t"]) >= 2
    commits = [e for e in report["timeline"]["events"] if e["kind"] == "commit"]
    assert len(commits) == report["windows"] == 8  # 2000 rows in windows of 250


def test_the_generation_report_draws_every_chart_with_the_reports_figures(runs):
    report = json.loads(runs["gen"].with_suffix(".json").read_text())
    f = check_page(runs["gen"].with_suffix(".html"), report, GENERATE_CHARTS, runs["root"] / "gen.png")
    for key, p in (("ttft_p50_ms", report["ttft"]["p50_ms"]), ("tpot_p99_ms", report["tpot"]["p99_ms"])):
        assert number(f[key]) == pytest.approx(p, abs=5e-4)
    assert number(f["completion_tokens"]) == report["completion_tokens"]
    assert number(f["prefix_hit_rate"]) == pytest.approx(100 * report["prefix_hit_rate"], abs=5e-3)
    assert report["prefix_hit_rate"] > 0  # NOTE: the shared system prompt
    hist = report["latency_histograms"]["ttft"]
    assert sum(hist["counts"]) == report["rows"] == 100


@pytest.mark.parametrize("run", ["emb", "gen"])
def test_hpcinfer_report_makes_the_same_page_from_the_json(runs, run):
    rebuilt = runs["root"] / f"{run}-rebuilt.html"
    hpcinfer("report", str(runs[run].with_suffix(".json")), "-o", str(rebuilt))
    assert rebuilt.read_bytes() == runs[run].with_suffix(".html").read_bytes()


def test_hpcinfer_report_refuses_what_is_not_a_report_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": 3}')
    done = subprocess.run(
        [sys.executable, "-m", "hpcinfer", "report", str(bad), "-o", str(tmp_path / "x.html")],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "not an hpcinfer report" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.html").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, str], float] | None:
    """Sample (name, label value) -> value, or None while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("hpcinfer_") and not s.name.endswith("_created"):
                values[(s.name, next(iter(s.labels.values()), ""))] = s.value
    return values


def test_a_prometheus_scrape_during_a_run_counts_up_to_the_reports_figures(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "rows.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(3000, seed=2))])
    port, report_path = free_port(), tmp_path / "report.json"
    args = [
        sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(tmp_path / "out.parquet"), "--model",
        str(tiny_model), "--sort-window", "100", "--max-batch-tokens", "1024", "--report", str(report_path),
        "--metrics-port", str(port), "--metrics-linger", "20", "-q",
        "--rate", "750",  # NOTE: rows arrive over 4 s however fast the machine is, so scrapes see them come
    ]  # fmt: skip
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    scrapes = []
    try:
        deadline = time.monotonic() + 240
        while not report_path.exists() and time.monotonic() < deadline and proc.poll() is None:
            if (values := scrape(port)) is not None:
                scrapes.append(values)
            time.sleep(0.1)
        time.sleep(0.5)  # NOTE: the report is written whole before the endpoint lingers
        final = scrape(port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert final is not None, proc.stderr.read()[-2000:] if proc.stderr else ""
    during = [s for s in scrapes if 0 < s.get(("hpcinfer_rows_total", "done"), 0) < 3000]
    assert len(during) >= 3, f"only {len(during)} scrapes while rows were still being written"
    counters = {k for s in scrapes for k in s if k[0].endswith("_total")}
    for key in counters:  # a counter never falls between scrapes
        seen = [s[key] for s in [*scrapes, final] if key in s]
        assert seen == sorted(seen), key
    report = json.loads(report_path.read_text())
    assert final[("hpcinfer_rows_total", "done")] + final[("hpcinfer_rows_total", "resumed")] == report["rows"]
    assert final[("hpcinfer_rows_total", "rejected")] == sum(report["rejects"].values())
    assert final[("hpcinfer_tokens_total", "input")] == report["real_tokens"]
    assert final[("hpcinfer_windows_committed_total", "")] == report["windows"] > 1
    for stage in report["stages"]:
        got = final[("hpcinfer_stage_busy_seconds_total", stage["stage"])]
        assert got == pytest.approx(stage["busy_s"], abs=1e-4)


def test_a_busy_metrics_port_and_a_missing_report_folder_are_one_line_errors_before_the_run(tmp_path, tiny_model):
    src = write_jsonl(tmp_path / "rows.jsonl", [{"id": i, "text": t} for i, t in enumerate(make_texts(5))])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for extra, said in (
            (["--metrics-port", str(port)], f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}"),
            (["--report-html", str(tmp_path / "no" / "r.html")], "--report-html: the folder"),
        ):
            out = tmp_path / "out.parquet"
            done = subprocess.run(
                [sys.executable, "-m", "hpcinfer", "run", str(src), "-o", str(out), "--model", str(tiny_model), *extra],
                env=ENV, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
            assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()
