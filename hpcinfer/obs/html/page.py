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
    return stable_ids(page)


_ID = re.compile(r"\b(p\d{4,}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b")


def stable_ids(page: str) -> str:
    """Bokeh's model ids (p1001...) and root ids (uuids) differ from one build to the next; numbered
    in order of appearance they do not."""
    seen: dict[str, str] = {}

    def renumber(match: re.Match[str]) -> str:
        return seen.setdefault(match.group(1), f"hp{len(seen) + 1}")

    head, marker, body = page.partition("<!-- report -->")  # NOTE: BokehJS itself is left as it is
    return head + marker + _ID.sub(renumber, body)


def write_report_html(report: dict[str, Any], path: str) -> None:
    Path(path).write_text(report_html(report), encoding="utf-8")
