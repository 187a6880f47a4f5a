"""The figures at the top of the HTML report, as the terminal shows them: (key, label, text) each,
formatted from the JSON report's own values (the browser test reads them back and compares)."""

from __future__ import annotations

from typing import Any

Row = tuple[str, str, str]


def _n(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.3f}"


def _ms(p: dict[str, float], key: str) -> str:
    return f"{p[key]:,.3f} ms" if key in p else "-"


def headline(report: dict[str, Any]) -> tuple[str, list[Row]]:
    if report.get("kind") == "tune":
        return tune_headline(report)
    rows: list[Row] = [
        ("rows", "rows written", _n(report.get("rows", 0))),
        ("rows_resumed", "rows resumed", _n(report.get("rows_resumed", 0))),
        ("rows_rejected", "rows rejected", _n(sum((report.get("rejects") or {}).values()))),
        ("wall_s", "wall time", f"{report.get('wall_s', 0.0):,.3f} s"),
    ]
    task = report.get("task") or report.get("config", {}).get("task", "embed")
    if task == "generate":
        rows += [
            ("prompt_tokens", "prompt tokens", _n(report.get("prompt_tokens", 0))),
            ("completion_tokens", "completion tokens", _n(report.get("completion_tokens", 0))),
            ("completion_tokens_per_s", "generated tokens/s", _n(report.get("completion_tokens_per_s", 0.0))),
            ("ttft_p50_ms", "time to first token, p50", _ms(report.get("ttft") or {}, "p50_ms")),
            ("ttft_p99_ms", "time to first token, p99", _ms(report.get("ttft") or {}, "p99_ms")),
            ("tpot_p50_ms", "time per output token, p50", _ms(report.get("tpot") or {}, "p50_ms")),
            ("tpot_p99_ms", "time per output token, p99", _ms(report.get("tpot") or {}, "p99_ms")),
            ("preemptions", "preemptions", _n(report.get("preemptions", 0))),
            ("peak_kv_blocks", "KV blocks, peak", _n(report.get("peak_kv_blocks", 0))),
            ("prefix_hit_rate", "prefix-cache hit rate", f"{report.get('prefix_hit_rate', 0.0):.2%}"),
        ]
    else:
        rows += [
            ("real_tokens", "tokens", _n(report.get("real_tokens", 0))),
            ("rows_per_s", "rows/s", _n(report.get("rows_per_s", 0.0))),
            ("tokens_per_s", "tokens/s", _n(report.get("tokens_per_s", 0.0))),
            ("batch_p50_ms", "batch latency, p50", _ms(report.get("batch_latency_ms") or {}, "p50")),
            ("batch_p99_ms", "batch latency, p99", _ms(report.get("batch_latency_ms") or {}, "p99")),
        ]
        if report.get("bottleneck"):
            rows.append(("bottleneck", "bottleneck", f"{report['bottleneck']}: {report.get('hint', '')}"))
    rows.append(("device", "device", f"{report.get('device', '')} ({report.get('dtype', '')})"))
    return f"hpcinfer {task}: {report.get('model', '')}", rows


def tune_headline(report: dict[str, Any]) -> tuple[str, list[Row]]:
    best = next(t for t in report["trials"] if t["index"] == report["best"])
    default = next(t for t in report["trials"] if t["index"] == report["default"])
    speed = report["speed"]
    unit = "tokens/s" if speed == "tokens_per_s" else "rows/s"
    rows: list[Row] = [
        ("trials", "trials", _n(len(report["trials"]))),
        ("objective", "objective", report["goal"]["objective"]),
        ("best_trial", "chosen trial", _n(best["index"])),
        ("best_speed", f"chosen: {unit}", _n(best[speed])),
        ("best_p99_ms", "chosen: p99 latency", f"{best['p99_ms']:,.3f} ms"),
        ("default_speed", f"default: {unit}", _n(default[speed])),
        ("chosen_knobs", "chosen settings", ", ".join(f"{k}={v}" for k, v in best["params"].items())),
        ("device", "device", report.get("device", "")),
    ]
    return f"hpcinfer tune: {report.get('model', '')}", rows
