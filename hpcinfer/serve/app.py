"""The HTTP side of `hpcinfer serve`: OpenAI's Files and Batches routes, on Starlette.

Routes answer in the shapes of the `openai` package's types (objects.py: `FileObject`, `FileDeleted`, `Batch`,
their pages) and fail in OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`)
with its status codes. With an API key set, every route needs it as a Bearer token; what a key
uploads or creates belongs to it (another key sees 404). Ids are opaque and checked against their
pattern before anything else: an id never becomes a path.

Each route is a module-level handler `(request, owner) -> Response`; what the server was started
with (its settings, its state, its batch runner) is the app's `state.served`, read by `served()`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from .objects import ApiError, batch_object, file_object
from .runner import BatchRunner
from .state import FINAL, BatchRow, FileRow, State

FILE_ID = re.compile(r"file-[0-9a-f]{24}")  # NOTE: fullmatch only: `$` would let a trailing newline through
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
WINDOW = re.compile(r"(\d{1,6})([smhd])")
LONGEST_WINDOW_S = 365 * 86400
MAX_JSON_BYTES = 1 << 20  # a batch's create request is a few hundred bytes
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
log = logging.getLogger("hpcinfer.serve")


@dataclass(frozen=True, slots=True)
class ServeSettings:
    data_dir: Path
    model: str  # as answers and batches name it
    endpoints: tuple[str, ...]  # what the model's task answers
    api_keys: tuple[str, ...]  # none: open (loopback only); else every route needs one of them
    max_file_bytes: int
    max_requests: int


@dataclass(frozen=True, slots=True)
class Served:
    """What every handler works on: the server's settings, its state and its batch runner."""

    settings: ServeSettings
    state: State
    runner: BatchRunner

    @property
    def files_dir(self) -> Path:
        return self.settings.data_dir / "files"

    def shown(self, row: BatchRow) -> JSONResponse:
        return JSONResponse(batch_object(row, self.settings.model, self.runner.live_completed(row.id)))


def served(request: Request) -> Served:
    return request.app.state.served


def owner_of(request: Request) -> str:
    """Who is asking: the hash of their API key ("" on an open server), or a 401."""
    api_keys = served(request).settings.api_keys
    if not api_keys:
        return ""
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    # NOTE: every key compared, in constant time each: which one matched takes no longer to find
    matched = [hmac.compare_digest(token.encode(), key.encode()) for key in api_keys]
    if not any(matched):
        raise ApiError(401, "Incorrect API key provided.", "invalid_api_key")
    return hashlib.sha256(token.encode()).hexdigest()


def own_file(request: Request, owner: str) -> FileRow:
    return owned(request, owner, "file_id", FILE_ID, served(request).state.file, "File")


def own_batch(request: Request, owner: str) -> BatchRow:
    return owned(request, owner, "batch_id", BATCH_ID, served(request).state.batch, "Batch")


def owned(
    request: Request, owner: str, key: str, pattern: re.Pattern[str], find: Callable[[str], Any], kind: str
) -> Any:
    """The row the path's id names, checked against its pattern first (an id never becomes a path),
    or OpenAI's 404 where there is none or `owner` does not own it (another key's rows are not shown)."""
    given = request.path_params[key]
    row = find(given) if pattern.fullmatch(given) else None
    if row is None or row.owner != owner:
        raise ApiError(404, f"No such {kind} object: {given}", param="id")
    return row


def too_large(max_file_bytes: int) -> ApiError:
    return ApiError(413, f"the file is larger than this server takes ({max_file_bytes:,} bytes)")


async def upload(request: Request, owner: str) -> Response:
    server = served(request)
    max_bytes = server.settings.max_file_bytes
    length = request.headers.get("content-length", "")
    if not length.isdigit():  # NOTE: a chunked body would be spooled whole before its size is known
        raise ApiError(411, "an upload needs its Content-Length", "length_required")
    if int(length) > max_bytes + 64 * 1024:
        raise too_large(max_bytes)
    form = await request.form(max_files=1, max_fields=8)
    upload_file, purpose = form.get("file"), form.get("purpose")
    if purpose != "batch":
        raise ApiError(400, f"purpose must be 'batch' (got {purpose!r})", "invalid_value", "purpose")
    if upload_file is None or isinstance(upload_file, str):
        raise ApiError(400, "a file is required (multipart field 'file')", "missing_required_parameter", "file")
    file_id = f"file-{secrets.token_hex(12)}"
    path = server.files_dir / f"{file_id}.jsonl"
    tmp, size = path.with_suffix(".upload"), 0
    with open(tmp, "wb") as fh:
        while chunk := await upload_file.read(1 << 20):
            size += len(chunk)
            if size > max_bytes:
                fh.close()
                tmp.unlink()
                raise too_large(max_bytes)
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())  # NOTE: on disk before a row of the state names it
    tmp.replace(path)
    name = Path(upload_file.filename or "upload.jsonl").name  # NOTE: a name to show, never a path to use
    row = FileRow(file_id, owner, name, "batch", size, int(time.time()), str(path))
    server.state.add_file(row)
    return JSONResponse(file_object(row))


async def list_files(request: Request, owner: str) -> Response:
    rows = served(request).state.files(owner, request.query_params.get("purpose"))
    return JSONResponse({"object": "list", "data": [file_object(r) for r in rows], "has_more": False})


async def get_file(request: Request, owner: str) -> Response:
    return JSONResponse(file_object(own_file(request, owner)))


async def file_content(request: Request, owner: str) -> Response:
    row = own_file(request, owner)
    path = served(request).files_dir / f"{row.id}.jsonl"
    if not path.is_file():
        raise ApiError(404, f"{row.id} has no content any more", "file_not_found")
    return FileResponse(path, media_type="application/jsonl", filename=row.filename)


async def delete_file(request: Request, owner: str) -> Response:
    server, row = served(request), own_file(request, owner)
    waiting = [b for b in server.state.batches(owner, None, 1 << 30)[0] if b.status not in FINAL]
    if any(b.input_file_id == row.id for b in waiting):
        # NOTE: 400, not 409: the client retries a 409
        raise ApiError(400, f"{row.id} is the input of a batch that has not ended; cancel it first", "file_in_use")
    server.state.delete_file(row.id)
    (server.files_dir / f"{row.id}.jsonl").unlink(missing_ok=True)
    return JSONResponse({"id": row.id, "object": "file", "deleted": True})


async def json_body(request: Request) -> dict[str, Any]:
    """A create request's body: a JSON object of at most MAX_JSON_BYTES, or a 400/413."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_JSON_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_JSON_BYTES:,} bytes")
    try:
        body = json.loads(raw)
    except ValueError:
        raise ApiError(400, "the request body is not JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    return body


def window_seconds(window: str) -> int:
    """A completion window ("24h", "7d") in seconds, or a 400."""
    matched = WINDOW.fullmatch(window)
    seconds = int(matched.group(1)) * SECONDS[matched.group(2)] if matched is not None else 0
    if not 0 < seconds <= LONGEST_WINDOW_S:
        message = f"completion_window {window!r}: give a duration such as 24h (at most 365d)"
        raise ApiError(400, message, "invalid_value")
    return seconds


def batch_priority(metadata: Any) -> int:
    """The batch's priority, from its metadata (OpenAI's limits on metadata: 16 string pairs), or a 400."""
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                   for k, v in metadata.items())
    ):  # fmt: skip
        message = "metadata is at most 16 keys of up to 64 characters, with string values of up to 512"
        raise ApiError(400, message, "invalid_value", "metadata")
    priority = (metadata or {}).get("priority", "0")
    if not re.fullmatch(r"-?\d{1,6}", priority):
        raise ApiError(400, "metadata.priority must be an integer", "invalid_value", "metadata")
    return int(priority)


async def create_batch(request: Request, owner: str) -> Response:
    server = served(request)
    body = await json_body(request)
    file_id = body.get("input_file_id")
    file = server.state.file(file_id) if isinstance(file_id, str) and FILE_ID.fullmatch(file_id) else None
    if file is None or file.owner != owner:
        raise ApiError(404, f"No such File object: {file_id}", param="input_file_id")
    if file.purpose != "batch":
        raise ApiError(400, f"{file_id} was not uploaded with purpose 'batch'", "invalid_value", "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in server.settings.endpoints:
        served_endpoints = ", ".join(server.settings.endpoints) or "none"
        message = f"endpoint {endpoint!r} is not served by this model (it serves {served_endpoints})"
        raise ApiError(400, message, "invalid_value", "endpoint")
    window = str(body.get("completion_window", "24h"))
    seconds = window_seconds(window)
    metadata = body.get("metadata")
    priority = batch_priority(metadata)
    now = int(time.time())
    row = BatchRow(
        f"batch_{secrets.token_hex(12)}", owner, 0, file.id, endpoint, window, metadata, priority,
        "validating", now, now + seconds,
    )  # fmt: skip
    server.state.add_batch(row)
    server.runner.wake()
    return server.shown(row)


async def get_batch(request: Request, owner: str) -> Response:
    return served(request).shown(own_batch(request, owner))


async def list_batches(request: Request, owner: str) -> Response:
    server = served(request)
    limit_text = request.query_params.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise ApiError(400, "limit must be between 1 and 100", "invalid_value", "limit")
    rows, more = server.state.batches(owner, request.query_params.get("after"), int(limit_text))
    data = [batch_object(r, server.settings.model, server.runner.live_completed(r.id)) for r in rows]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})


async def cancel_batch(request: Request, owner: str) -> Response:
    server, row = served(request), own_batch(request, owner)
    if row.status not in FINAL:
        row = server.state.request_cancel(row.id)
        server.runner.cancel(row.id)
        await run_in_threadpool(server.runner.cancel_waiting, row.id)
        row = server.state.batch(row.id) or row
    return server.shown(row)


def route(path: str, handler: Callable[[Request, str], Awaitable[Response]], method: str) -> Route:
    """`handler` behind the API key check, its ApiError answered in OpenAI's error shape."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, owner_of(request))
        except ApiError as exc:
            return exc.response()

    return Route(path, endpoint, methods=[method])


ROUTES = [
    route("/v1/files", upload, "POST"),
    route("/v1/files", list_files, "GET"),
    route("/v1/files/{file_id}", get_file, "GET"),
    route("/v1/files/{file_id}/content", file_content, "GET"),
    route("/v1/files/{file_id}", delete_file, "DELETE"),
    route("/v1/batches", create_batch, "POST"),
    route("/v1/batches", list_batches, "GET"),
    route("/v1/batches/{batch_id}", get_batch, "GET"),
    route("/v1/batches/{batch_id}/cancel", cancel_batch, "POST"),
]


async def http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 400)
    if status == 404:
        return ApiError(404, f"no route {request.method} {request.url.path}").response()
    if status == 405:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()
    return ApiError(status, str(getattr(exc, "detail", "") or "bad request")).response()  # a bad multipart body


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed", request.method, request.url.path)  # NOTE: details in the server's log only
    return ApiError(500, "the server failed on this request; its log has the details", "server_error").response()


def build_app(settings: ServeSettings, state: State, runner: BatchRunner) -> Starlette:
    (settings.data_dir / "files").mkdir(parents=True, exist_ok=True)
    app = Starlette(routes=ROUTES, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.served = Served(settings, state, runner)
    return app
