"""What is watched around one run, and written after it: the timeline (timeline.py), the metrics
endpoint (metrics.py), then the JSON report and the HTML one (html/).

`Observed` starts the timeline and the endpoint on entry and stops both however the run ends; a
run that finishes hands its report to `finish`, which adds the timeline and the machine to it,
writes the files asked for, and keeps the endpoint up `linger_s` longer so a scraper sees the
final figures.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, OutputError
from .meter import Meter
from .timeline import Timeline

AUTO_HTML_AFTER_S = 60.0  # --report-html auto: a run at least this long gets its HTML report


@dataclass(frozen=True, slots=True)
class ReportFiles:
    json_path: str | None = None
    html: str = "auto"  # auto | off | a path
    output: str = ""  # the run's output: auto writes OUTPUT.report.html beside it
    metrics_port: int | None = None
    linger_s: float = 0.0

    def html_path(self, wall_s: float) -> str | None:
        if self.html == "off":
            return None
        if self.html == "auto":
            return f"{self.output}.report.html" if wall_s >= AUTO_HTML_AFTER_S and self.output else None
        return self.html


class Observed:
    def __init__(self, meter: Meter, files: ReportFiles, machine: Callable[[], dict[str, Any]]) -> None:
        self.meter, self.files, self.machine = meter, files, machine
        self.timeline = Timeline(meter)
        self.server: Any = None

    def __enter__(self) -> Observed:
        for flag, path in (("--report", self.files.json_path), ("--report-html", self.files.html)):
            if path and path not in ("auto", "off") and "://" not in path and not Path(path).resolve().parent.is_dir():
                raise ConfigError(f"{flag}: the folder {Path(path).parent} does not exist", path=path)
        if self.files.metrics_port is not None:
            from .metrics import MetricsServer  # NOTE: prometheus_client only when asked

            self.server = MetricsServer(self.meter, self.files.metrics_port)
        self.timeline.start()
        return self

    def finish(self, report: Any) -> None:
        """The finished run's report gets its timeline and machine (a report with fields for them:
        every built-in task's); the files asked for are written, the HTML from a report that has them."""
        self.timeline.stop()
        charted = hasattr(report, "timeline")
        if charted:
            report.timeline = self.timeline.to_dict()
            report.machine = self.machine()
        if self.files.json_path:
            try:
                report.write_json(self.files.json_path)
            except OSError as exc:  # NOTE: the output is committed already; only the report is missing
                raise OutputError(
                    f"the run finished and its output is written, but not its report: {exc.strerror or exc}",
                    path=self.files.json_path,
                ) from None
        html = self.files.html_path(getattr(report, "wall_s", 0.0)) if charted else None
        if html:
            self._write_html(report, html)
        if self.server is not None and self.files.linger_s > 0:
            with contextlib.suppress(KeyboardInterrupt):  # NOTE: the run is done and written: Ctrl-C ends the wait
                time.sleep(self.files.linger_s)

    def _write_html(self, report: Any, path: str) -> None:
        """The HTML report; one asked for by name that cannot be written is an error, the `auto` one
        a warning (a page nobody named never fails a finished run)."""
        from .html.page import write_report_html  # NOTE: the plotting library only when a page is made

        try:
            write_report_html(report.to_dict(), path)
        except Exception as exc:  # noqa: BLE001
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            why = why.splitlines()[0] if why else type(exc).__name__
            if self.files.html != "auto":
                raise OutputError(f"the run finished and its output is written, but not its HTML report: {why}",
                                  path=path) from None  # fmt: skip
            print(f"hpcinfer: {path}: the HTML report could not be written: {why}", file=sys.stderr)
            return
        report.html_report = path

    def __exit__(self, *exc: object) -> None:
        self.timeline.stop()
        if self.server is not None:
            self.server.close()
