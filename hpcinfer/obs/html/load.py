"""A JSON report read back for `hpcinfer report`, checked enough to say in one line what is wrong."""

from __future__ import annotations

import json
from typing import Any

from ...errors import ConfigError


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
    if report.get("kind") != "tune" and "timeline" not in report:
        raise ConfigError("this report has no timeline (written by an older hpcinfer); run again", path=path)
    return report
