"""A batch's input file checked before it runs (`validating`), as OpenAI checks one.

What makes the file no batch file fails the batch, every problem listed with its line (OpenAI's
`errors.data`: code, message, line, param): a line that is not a JSON object, a missing or
repeated `custom_id`, a method other than POST, a url other than the batch's endpoint, no `body`
object, more requests than the server takes, no request at all. What is wrong inside a request's
body (no messages, a bad max_tokens) is that request's problem: the run answers it in the error
file and goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_LISTED = 1000  # problems listed per batch; a file of nothing but bad lines says so in the first ones
MOST_SHOWN = 64  # characters of a client's value (custom_id, url) quoted in a message: a batch stays small to read


def shown(value: object) -> str:
    """A client's value as a message quotes it, cut to MOST_SHOWN characters."""
    text = repr(value)
    return text if len(text) <= MOST_SHOWN else text[: MOST_SHOWN - 3] + "..."


@dataclass(slots=True)
class Checked:
    requests: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)


def check_batch_file(path: Path, endpoint: str, max_requests: int) -> Checked:
    checked = Checked()
    seen: dict[str, int] = {}

    def problem(code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(checked.errors) < MAX_LISTED:
            checked.errors.append({"code": code, "message": message, "line": line, "param": param})

    with open(path, "rb") as fh:
        for line, raw in enumerate(fh, start=1):
            if line == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # NOTE: a byte order mark, as `hpcinfer run` reads one
            if not raw.strip():
                continue
            try:
                obj = json.loads(
                    raw.decode("utf-8")
                )  # NOTE: not json.loads(bytes), which takes UTF-16/32 the run cannot read
            except UnicodeDecodeError:
                problem("invalid_json_line", "this line is not UTF-8 text", line)
                continue
            except ValueError:
                problem("invalid_json_line", "this line is not valid JSON", line)
                continue
            if not isinstance(obj, dict):
                problem("invalid_json_line", "this line is not a JSON object", line)
                continue
            custom_id = obj.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                problem("missing_required_parameter", "custom_id is required (a non-empty string)", line, "custom_id")
            elif custom_id in seen:
                message = f"custom_id {shown(custom_id)} is on line {seen[custom_id]} too; each must be unique"
                problem("duplicate_custom_id", message, line, "custom_id")
            else:
                seen[custom_id] = line
            if obj.get("method", "POST") != "POST":
                problem("invalid_method", "method must be POST", line, "method")
            if obj.get("url") != endpoint:
                problem(
                    "invalid_url", f"url {shown(obj.get('url'))} is not the batch's endpoint {endpoint}", line, "url"
                )
            if not isinstance(obj.get("body"), dict):
                problem("missing_required_parameter", "body is required (a JSON object)", line, "body")
            checked.requests += 1
    if checked.requests > max_requests:
        problem("too_many_requests", f"{checked.requests:,} requests; a batch holds at most {max_requests:,}", None)
    if checked.requests == 0 and not checked.errors:
        problem("empty_file", "the file holds no request", None)
    return checked
