"""What a batch's job produced, read for its output and error files: the job's answer lines (its
output, or the parts its committed windows wrote), the input's requests that never ran, and what the
answers add up to (counts and OpenAI's token usage); the ids and error entries the files carry."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..files.parts import parts_dir


class Tally:
    """What a batch's answers add up to: requests answered and failed, and OpenAI's token usage."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.good = self.bad = 0
        self.input_tokens = self.output_tokens = self.cached_tokens = 0

    def add(self, custom_id: str, answer: dict[str, Any]) -> None:
        self.seen.add(custom_id)
        if answer.get("error") is not None:
            self.bad += 1
            return
        self.good += 1
        usage = ((answer.get("response") or {}).get("body") or {}).get("usage") or {}
        # NOTE: chat and completions count prompt_/completion_tokens; a Response input_/output_tokens
        self.input_tokens += int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
        self.output_tokens += int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        self.cached_tokens += int(details.get("cached_tokens") or 0)

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def request_id(batch_id: str, custom_id: str) -> str:
    """An answer line's id: unique across the server's batches, the same when a batch is finalized again."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}/{custom_id}".encode()).hexdigest()[:24]


def problem(code: str, message: str | None = None) -> dict[str, Any]:
    """An `errors.data` entry; the message says what happened without the server's paths."""
    shown = {"server_error": "the server failed on this batch; its log has the details",
             "file_not_found": "the input file was deleted"}  # fmt: skip
    return {"code": code, "message": message or shown.get(code, code), "line": None, "param": None}


def answer_lines(output: Path) -> Iterator[bytes]:
    """The job's answer lines, one at a time: its output once complete, else the parts its committed
    windows wrote."""
    if output.exists():
        files = [output]
    else:
        folder = parts_dir(str(output))
        try:
            manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        files = [folder / w["part"] for w in sorted(manifest.get("windows", []), key=lambda w: w["window"])]
    for path in files:
        with open(path, "rb") as fh:
            for line in fh:
                if line.strip():
                    yield line if line.endswith(b"\n") else line + b"\n"


def unfinished(input_path: Path, seen: set[str]) -> Iterator[str]:
    """The input's custom ids not among `seen`, in input order, each once. The file may never have
    passed validation (a batch cancelled or expired before it): a line that is no request is skipped."""
    try:
        fh = open(input_path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return  # NOTE: deleted with its batch: no request of it can be named
    with fh:
        for raw in fh:
            try:
                obj = json.loads(raw.decode("utf-8-sig"))
            except (ValueError, UnicodeDecodeError):
                continue
            custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
            if isinstance(custom_id, str) and custom_id and custom_id not in seen:
                seen.add(custom_id)
                yield custom_id


def committed_rows(output: Path) -> int:
    """Requests a killed run had committed (a resumed batch counts them as completed from the start)."""
    try:
        manifest = json.loads((parts_dir(str(output)) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    return sum(int(w.get("rows", 0)) for w in manifest.get("windows", []))
