"""An HTML report opened in headless Chromium (Debian's `chromium`, driven by playwright) with the
network off: what the page logged as errors, what each chart plots, the figures it shows."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

READ_PAGE = """() => {
  const doc = Bokeh.documents[0];
  const charts = {};
  for (const section of document.querySelectorAll('section[data-chart]')) {
    const key = section.dataset.chart;
    const fig = doc.get_model_by_name('chart:' + key);
    charts[key] = fig === null ? null : fig.renderers.map(r => {
      const data = r.data_source.data;
      const columns = data instanceof Map ? [...data.values()] : Object.values(data);
      return columns.length ? columns[0].length : 0;
    });
  }
  const figures = {};
  for (const cell of document.querySelectorAll('[data-figure]')) figures[cell.dataset.figure] = cell.textContent;
  return {charts, figures, drawn: document.querySelectorAll('.bk-Figure, .bk-Plot').length};
}"""


def chromium() -> str:
    """Debian's chromium (the README's test command installs it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed: apt-get install chromium (the README's test command does)"
    return path


def open_report(page_path: Path, screenshot: Path | None = None) -> dict[str, Any]:
    """{"charts": key -> points per renderer, "figures": key -> text, "errors": [...], "requests": [...]}."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium())
        try:
            context = browser.new_context(viewport={"width": 1000, "height": 900})
            context.set_offline(True)
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.resolve().as_uri())
            page.wait_for_function("window.Bokeh !== undefined && Bokeh.documents.length > 0", timeout=60_000)
            page.wait_for_function("document.querySelectorAll('.bk-Figure, .bk-Plot').length > 0", timeout=60_000)
            seen = page.evaluate(READ_PAGE)
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return {**seen, "errors": errors, "requests": requests}
