"""A JSON report read back for `hpcinfer report`, checked enough to say in one line what is wrong."""

from __future__ import annotations

import json
from typing import Any

from ...errors import ConfigError, OutputError


def read_report(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except FileNotFoundError:
        raise ConfigError("no such file", path=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read it: {exc}", path=path) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not JSON (line {exc.lineno}: {exc.msg})", path=path) from None
    if not isinstance(report, dict) or "schema_version" not in report:
        raise ConfigError("not an hpcinfer report (no schema_version): write one with --report", path=path)
    if report.get("kind") == "tune":
        if not isinstance(report.get("trials"), list) or not report["trials"]:
            raise ConfigError("a tune report without trials", path=path)
    elif not isinstance(report.get("timeline"), dict):
        raise ConfigError("this report has no timeline (written by an older hpcinfer); run again", path=path)
    return report


def write_page(report: dict[str, Any], json_path: str, html_path: str) -> None:
    """The page of a report read back; a report the page cannot be made of is one line, naming it."""
    from .page import write_report_html

    try:
        write_report_html(report, html_path)
    except OSError as exc:
        raise OutputError(f"cannot write it: {exc.strerror or exc}", path=html_path) from None
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, StopIteration) as exc:
        raise ConfigError(
            f"not a report this hpcinfer can draw ({type(exc).__name__}: {exc})", path=json_path
        ) from None
