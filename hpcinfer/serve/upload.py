"""A multipart upload (`POST /v1/files`) streamed straight into its file under the data directory.

Starlette's own form parser spools a file part to `$TMPDIR` before the handler sees it, so an
upload would take twice its size on disk and be copied once more; here python-multipart's
streaming parser hands each piece of the `file` part to a writer that appends it to the upload's
own `.upload` file (the writes and the final `fsync` in a worker thread, so the event loop keeps
serving other clients). Whatever goes wrong (too large, a bad body, a client that hangs up), the
`.upload` file is removed; only a complete upload is renamed to its id.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import python_multipart
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from .objects import ApiError

WRITE_BYTES = 1 << 20  # gathered before a write: few thread hops per upload
MOST_FIELD_BYTES = 1024  # `purpose` and the like
MOST_PARTS = 8


@dataclass(slots=True)
class Part:
    name: str = ""
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


@dataclass(slots=True)
class Received:
    size: int  # bytes of the file part
    filename: str
    fields: dict[str, str]  # the form's other fields (purpose)


@dataclass(slots=True)
class _FilePart:
    size: int = 0
    part: Part | None = None


def over_quota(max_key_bytes: int) -> ApiError:
    message = f"this key's files would hold more than this server keeps per key ({max_key_bytes:,} bytes); delete some"
    return ApiError(413, message, "quota_exceeded")


class InFlight:
    """Bytes of the uploads still streaming, per key: the quota counts them, so uploads sent in
    parallel cannot each pass a check that counts only what is stored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}

    def take(self, owner: str, size: int, stored: int, quota: int) -> None:
        with self._lock:
            if stored + self._bytes.get(owner, 0) + size > quota:
                raise over_quota(quota)
            self._bytes[owner] = self._bytes.get(owner, 0) + size

    def give_back(self, owner: str, size: int) -> None:
        with self._lock:
            self._bytes[owner] -= size


def too_large(max_file_bytes: int) -> ApiError:
    return ApiError(413, f"the file is larger than this server takes ({max_file_bytes:,} bytes)")


async def receive_upload(request: Request, target: Path, max_bytes: int) -> Received:
    """Streams the request's multipart `file` part into `target` (written whole, fsynced, or not
    at all) and returns what the form held; an ApiError for a body that is no such form."""
    media, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if media != b"multipart/form-data" or not boundary:
        raise ApiError(400, "an upload is a multipart/form-data body (fields 'file' and 'purpose')", "invalid_request")
    parts: list[Part] = []
    headers: dict[str, str] = {}
    header = [b"", b""]
    pending = bytearray()
    state = _FilePart()
    fh = open(target, "wb")  # noqa: SIM115 - closed below, on every path
    problem: list[ApiError] = []

    def on_part_begin() -> None:
        if len(parts) >= MOST_PARTS:
            problem.append(ApiError(400, f"an upload has at most {MOST_PARTS} form fields", "invalid_request"))
        parts.append(Part())
        headers.clear()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        headers[header[0].decode("latin-1").lower()] = header[1].decode("latin-1")
        header[0] = header[1] = b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(headers.get("content-disposition", ""))
        part = parts[-1]
        part.name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        part.filename = filename.decode("utf-8", "replace") if filename is not None else None

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part = parts[-1]
        if part.name == "file" and part.filename is not None:
            if state.part is not None and state.part is not part:
                problem.append(ApiError(400, "an upload holds one file", "invalid_request", "file"))
                return
            state.part = part
            state.size += end - start
            if state.size > max_bytes:
                problem.append(too_large(max_bytes))
                return
            pending.extend(data[start:end])
        elif len(part.value) + end - start <= MOST_FIELD_BYTES:
            part.value.extend(data[start:end])
        else:
            problem.append(ApiError(400, f"form field {part.name!r} is too long", "invalid_request", part.name))

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_part_data": on_part_data,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
    }
    complete = False
    try:
        parser = python_multipart.MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
        async for chunk in request.stream():
            parser.write(chunk)
            if problem:
                raise problem[0]
            if len(pending) >= WRITE_BYTES:
                data = bytes(pending)
                pending.clear()
                await run_in_threadpool(fh.write, data)
        parser.finalize()
        if problem:
            raise problem[0]
        await run_in_threadpool(_finish, fh, bytes(pending))
        complete = True
    except FormParserError:
        raise ApiError(400, "the upload is not a well-formed multipart body", "invalid_request") from None
    finally:
        fh.close()
        if not complete:
            target.unlink(missing_ok=True)  # NOTE: nothing of a failed upload stays on disk
    file_part = next((p for p in parts if p.name == "file" and p.filename is not None), None)
    if file_part is None:
        target.unlink(missing_ok=True)
        raise ApiError(400, "a file is required (multipart field 'file')", "missing_required_parameter", "file")
    fields = {p.name: p.value.decode("utf-8", "replace") for p in parts if p is not file_part}
    return Received(state.size, file_part.filename or "upload.jsonl", fields)


def _finish(fh: BinaryIO, rest: bytes) -> None:
    fh.write(rest)
    fh.flush()
    os.fsync(fh.fileno())  # NOTE: on disk before a row of the state names it
