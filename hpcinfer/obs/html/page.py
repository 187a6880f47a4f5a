"""The HTML report: one self-contained file (BokehJS inlined, no network at view time) made from a
report's JSON alone, so `hpcinfer report REPORT.json -o report.html` makes the same page the run did.

At the top: the figures a run ends with (each cell `data-figure="KEY"`), the accounting line, the
machine and the run's settings; then the charts (charts.py, tune_charts.py), each in a
`<section data-chart="KEY">`. Bokeh's element ids are renumbered in order of appearance, so one
JSON always makes byte-identical HTML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment
from markupsafe import Markup

from .figures import headline
from .page_template import TEMPLATE


@dataclass(frozen=True, slots=True)
class Figure:
    key: str
    label: str
    text: str


def report_html(report: dict[str, Any]) -> str:
    from bokeh.embed import components
    from bokeh.embed.bundle import bundle_for_objs_and_resources
    from bokeh.resources import INLINE

    if report.get("kind") == "tune":
        from .tune_charts import tune_charts

        charts = tune_charts(report)
    else:
        from .charts import run_charts

        charts = run_charts(report)
    figures_ = [c.figure for c in charts]
    script, divs = components(figures_) if charts else ("", [])
    script, *divs = stable_ids([script, *divs], set(re.findall(r'"id":"(p\d+)"', script)))
    # NOTE: only the BokehJS the charts need (not widgets, tables, WebGL, MathJax), inlined
    bundle = bundle_for_objs_and_resources(figures_, INLINE) if charts else None
    bokeh_js = "".join(f"<script>{js}</script>" for js in bundle.js_raw) if bundle else ""
    title, figures = headline(report)
    env = Environment(autoescape=True)
    page = env.from_string(TEMPLATE).render(
        title=title,
        figures=[Figure(*f) for f in figures],
        accounting=report.get("accounting") or {},
        machine=report.get("machine") or {},
        settings=sorted((report.get("config") or {}).items()),
        charts=[(c, Markup(div)) for c, div in zip(charts, divs, strict=True)],
        bokeh=Markup(bokeh_js),
        script=Markup(script),
    )
    return page


_ID = re.compile(r"\b(p\d{4,}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b")


def stable_ids(parts: list[str], model_ids: set[str]) -> list[str]:
    """Bokeh's model ids (`model_ids`: the p1001... its script defines) and its document and element
    ids (uuids) differ from one build to the next; numbered in order of appearance across its script
    and divs (one map: they refer to each other), they do not. Only Bokeh's own parts are
    renumbered, never the page's text, and a p-number only where it is a model's id."""
    seen: dict[str, str] = {}

    def renumber(match: re.Match[str]) -> str:
        found = match.group(1)
        if found.startswith("p") and found not in model_ids:
            return found
        return seen.setdefault(found, f"hp{len(seen) + 1}")

    return [_ID.sub(renumber, part) for part in parts]


def write_report_html(report: dict[str, Any], path: str) -> None:
    """The page, at a local path or as one object on a store (`s3://bucket/out.parquet.report.html`)."""
    from ...files import storage

    page = report_html(report)
    if storage.is_remote(path):
        fs, key = storage.filesystem(path)
        fs.pipe_file(key, page.encode("utf-8"))
        return
    Path(storage.local_path(path)).write_text(page, encoding="utf-8")
