"""The run's figures over time: the timeline stays bounded however long the job, counters stay
exact where they are kept, events are thinned, and the Prometheus exposition says what the meter
does (parsed by prometheus_client's own parser)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hpcinfer.obs.meter import COUNTER, MAX_COMMIT_EVENTS, Meter
from hpcinfer.obs.timeline import Timeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def long_job(hours: float, step_s: float = 1.0) -> tuple[Timeline, Meter, FakeClock]:
    """A job of `hours` sampled every `step_s`, rows at 10/s, a gauge going 0..9, a commit a minute."""
    clock = FakeClock()
    meter = Meter(clock=clock)
    timeline = Timeline(meter, interval_s=step_s)
    rows = {"n": 0}
    meter.probe("rows.done", lambda: rows["n"], COUNTER)
    meter.probe("running", lambda: rows["n"] // 10 % 10)
    for second in range(int(hours * 3600 / step_s)):
        clock.now += step_s
        rows["n"] += int(10 * step_s)
        if second % 60 == 0:
            meter.event("commit", window=second // 60, rows=600)
        timeline.sample()
    return timeline, meter, clock


def test_a_ten_hour_timeline_keeps_as_many_points_as_a_ten_minute_one():
    short, _, _ = long_job(10 / 60)
    long, _, _ = long_job(10)
    s, t = short.to_dict(), long.to_dict()
    assert len(s["t"]) <= short.max_points and len(t["t"]) <= long.max_points
    assert len(t["t"]) >= long.max_points // 2  # NOTE: halved, not collapsed
    assert t["interval_s"] > s["interval_s"]
    size_short, size_long = len(json.dumps(s)), len(json.dumps(t))
    assert size_long < 10 * size_short, (size_short, size_long)  # the same order
    longer, _, _ = long_job(100, step_s=10)
    assert len(json.dumps(longer.to_dict())) < 1.5 * size_long  # NOTE: bounded: 10x longer, no bigger


def test_counters_stay_exact_at_the_points_kept_and_gauges_are_averaged():
    timeline, _, _ = long_job(2)
    d = timeline.to_dict()
    for t, rows in zip(d["t"], d["series"]["rows.done"], strict=True):
        assert rows == pytest.approx(10 * t)  # 10 rows a second since the start, exactly
    assert all(0 <= v <= 9 for v in d["series"]["running"])
    assert any(v != int(v) for v in d["series"]["running"])  # NOTE: merged pairs are means


def test_commit_marks_are_thinned_to_a_bound_and_the_dropped_counted():
    _, meter, _ = long_job(10)
    events, dropped = meter.event_list()
    commits = [e for e in events if e["kind"] == "commit"]
    assert len(commits) <= MAX_COMMIT_EVENTS
    assert len(commits) + dropped == 600  # one a minute for 10 hours
    assert [e["t"] for e in commits] == sorted(e["t"] for e in commits)


def test_times_count_from_the_job_start_and_earlier_samples_are_negative():
    clock = FakeClock()
    meter = Meter(clock=clock)
    timeline = Timeline(meter)
    timeline.sample()
    clock.now += 5  # the model loads
    meter.job_started()
    clock.now += 2
    meter.event("commit", window=0, rows=1)
    timeline.sample()
    d = timeline.to_dict()
    assert d["t"] == [-5.0, 2.0]
    assert d["events"][0]["t"] == 2.0


def test_a_counter_registered_again_goes_on_from_where_it_had_got():
    meter = Meter()
    meter.probe("stage_busy_s.compute", lambda: 3.0, COUNTER, carry=True)
    meter.probe("stage_busy_s.compute", lambda: 1.0, COUNTER, carry=True)  # a restarted pipeline
    assert meter.read()["stage_busy_s.compute"] == 4.0


def test_a_failing_probe_is_left_out_of_one_read_not_fatal():
    meter = Meter()
    meter.probe("running", lambda: 1 / 0)
    meter.add("rows_finished", 3)
    assert meter.read() == {"rows_finished": 3}


def test_the_prometheus_exposition_names_the_meter_figures_by_convention():
    from prometheus_client import CollectorRegistry

    from hpcinfer.obs.metrics import MeterCollector

    meter = Meter()
    meter.probe("rows.done", lambda: 7, COUNTER)
    meter.probe("rows.rejected", lambda: 2, COUNTER)
    meter.probe("tokens.prompt", lambda: 100, COUNTER)
    meter.probe("kv_blocks_used", lambda: 12)
    meter.set("breaker_state.cpu#1", 2)
    meter.add("rows_finished", 9)  # NOTE: the chart's own figure, not exported
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MeterCollector(meter))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    rows = {s.labels["status"]: s.value for s in families["hpcinfer_rows"].samples if s.name.endswith("_total")}
    assert families["hpcinfer_rows"].type == "counter" and rows == {"done": 7, "rejected": 2}
    assert families["hpcinfer_kv_blocks_used"].type == "gauge"
    assert families["hpcinfer_device_breaker_state"].samples[0].labels == {"device": "cpu#1"}
    assert not any("finished" in name for name in families)


def test_rates_shares_and_breaker_spans_from_a_timeline():
    from hpcinfer.obs.html.series import breaker_spans, rate, shares

    tl = {
        "t": [0.0, 1.0, 2.0, 4.0],
        "series": {
            "rows.done": [0, 10, 30, 30],
            "stage_busy_s.tokenize": [0, 1.0, 3.0, 5.0],
            "cached": [0, 5, 5, 8],
            "prompt": [0, 10, 10, 20],
        },
        "events": [
            {"t": 1.0, "kind": "breaker", "device": "cpu#1", "state": "open"},
            {"t": 2.0, "kind": "breaker", "device": "cpu#1", "state": "half-open"},
            {"t": 3.0, "kind": "breaker", "device": "cpu#1", "state": "closed"},
            {"t": 3.5, "kind": "breaker", "device": "cpu#0", "state": "open"},
        ],
    }
    assert rate(tl, "rows.done") == ([1.0, 2.0, 4.0], [10.0, 20.0, 0.0])
    assert shares(tl, "stage_busy_s", {"tokenize": 2})["tokenize"] == ([1.0, 2.0, 4.0], [0.5, 1.0, 0.5])
    assert rate(tl, "cached", per="prompt") == ([1.0, 4.0], [0.5, 0.3])  # no new prompt tokens at t=2
    assert breaker_spans(tl, end=4.0) == [
        {"device": "cpu#1", "state": "open", "start": 1.0, "end": 2.0},
        {"device": "cpu#1", "state": "half-open", "start": 2.0, "end": 3.0},
        {"device": "cpu#0", "state": "open", "start": 3.5, "end": 4.0},
    ]


def test_the_pareto_front_keeps_the_trials_no_other_beats_on_both():
    from hpcinfer.obs.html.tune_charts import pareto_front

    trials = [
        {"index": 0, "rows_per_s": 100, "p99_ms": 50, "status": "ok"},
        {"index": 1, "rows_per_s": 120, "p99_ms": 80, "status": "ok"},
        {"index": 2, "rows_per_s": 90, "p99_ms": 60, "status": "ok"},  # beaten by 0 on both
        {"index": 3, "rows_per_s": 150, "p99_ms": 200, "status": "over-limit"},
        {"index": 4, "rows_per_s": 999, "p99_ms": 1, "status": "infeasible"},  # never measured
    ]
    assert [t["index"] for t in pareto_front(trials, "rows_per_s")] == [0, 1, 3]


def test_a_counter_merged_over_a_missing_sample_is_unknown_not_moved():
    clock = FakeClock()
    meter = Meter(clock=clock)
    timeline = Timeline(meter, max_points=4)
    values = iter([0, 10, None, 30])

    def read() -> float:
        value = next(values)
        if value is None:
            raise RuntimeError("torn down")  # NOTE: a probe that fails leaves its sample empty
        return value

    meter.probe("rows.done", read, COUNTER)
    for _ in range(4):
        clock.now += 1
        timeline.sample()
    d = timeline.to_dict()
    assert d["series"]["rows.done"] == [10, 30]  # (0, 10) -> 10; (None, 30) -> 30, each at its later time
    assert d["t"] == [2.0, 4.0] and d["interval_s"] == 0.5


def test_the_page_keeps_the_users_text_and_one_json_makes_the_same_bytes():
    from hpcinfer.obs.html.page import report_html

    timeline, _, _ = long_job(0.05)
    output = "/data/run-12345678-1234-1234-1234-123456789abc/out.parquet"
    report = {
        "schema_version": 1, "rows": 1800, "rejects": {}, "wall_s": 180.0, "model": "p1234", "device": "cpu",
        "dtype": "float32", "timeline": timeline.to_dict(), "config": {"task": "embed", "output.path": output},
    }  # fmt: skip
    page = report_html(report)
    assert page == report_html(report)  # NOTE: Bokeh's own ids renumbered the same way each time
    assert "p1234" in page and output in page
