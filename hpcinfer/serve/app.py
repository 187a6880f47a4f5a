"""The HTTP side of `hpcinfer serve`: OpenAI's Files and Batches routes, on Starlette.

Routes answer in the shapes of the `openai` package's types (objects.py: `FileObject`, `FileDeleted`, `Batch`,
their pages) and fail in OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`)
with its status codes. Every route needs an API key as a Bearer token (unless the server was
started with --no-auth); what a key uploads or creates belongs to it (another key sees 404). The
Host header must name the host the server is bound to (a page in a browser cannot reach a loopback
server through a DNS name of its own). Ids are opaque and checked against their pattern before
anything else: an id never becomes a path.

Each route is a module-level handler `(request, owner) -> Response`: async where it reads the
body, else a plain function run in a worker thread (the state's lock and SQLite's fsyncs never
hold the event loop, so polling stays fast while the runner writes). What the server was started
with (its settings, its state, its batch runner) is the app's `state.served`, read by `served()`.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from ..files.atomic import fsync_dir
from .access import check_host, owner_of
from .objects import ApiError, batch_object, file_object
from .runner import BatchRunner
from .state import FINAL, BatchRow, FileRow, State
from .upload import InFlight, receive_upload, too_large

FILE_ID = re.compile(r"file-[0-9a-f]{24}")  # NOTE: fullmatch only: `$` would let a trailing newline through
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
LIMIT = re.compile(r"[0-9]{1,6}")  # NOTE: not str.isdigit, which takes "²" that int() then refuses
COMPLETION_WINDOW = "24h"  # OpenAI's only window
COMPLETION_WINDOW_S = 24 * 3600
MAX_JSON_BYTES = 1 << 20  # a batch's create request is a few hundred bytes
MOST_FILES_LISTED = 10_000  # OpenAI's default and largest `limit` for GET /v1/files
log = logging.getLogger("hpcinfer.serve")


@dataclass(frozen=True, slots=True)
class ServeSettings:
    data_dir: Path
    model: str  # as answers and batches name it
    endpoints: tuple[str, ...]  # what the model's task answers
    api_keys: tuple[str, ...]  # none: open (--no-auth, loopback only); else every route needs one of them
    max_file_bytes: int
    max_requests: int
    max_key_bytes: int = 0  # what one key's files may hold in all; 0: no quota
    hosts: frozenset[str] | None = None  # the Host headers taken (None: any, a server bound to every address)


@dataclass(frozen=True, slots=True)
class Served:
    """What every handler works on: the server's settings, its state and its batch runner."""

    settings: ServeSettings
    state: State
    runner: BatchRunner
    in_flight: InFlight = field(default_factory=lambda: InFlight())

    @property
    def files_dir(self) -> Path:
        return self.settings.data_dir / "files"

    def shown(self, row: BatchRow) -> JSONResponse:
        return JSONResponse(batch_object(row, self.settings.model, self.runner.live_completed(row.id)))


def served(request: Request) -> Served:
    return request.app.state.served


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


async def upload(request: Request, owner: str) -> Response:
    server = served(request)
    max_bytes, quota = server.settings.max_file_bytes, server.settings.max_key_bytes
    length = request.headers.get("content-length", "")
    if not (length.isascii() and length.isdigit()):
        raise ApiError(411, "an upload needs its Content-Length", "length_required")  # NOTE: sized before it is read
    if int(length) > max_bytes + 64 * 1024:
        raise too_large(max_bytes)
    if not quota:
        return await _upload(request, owner, server, max_bytes)
    server.in_flight.take(owner, int(length), await run_in_threadpool(server.state.bytes_of, owner), quota)
    try:  # NOTE: the body's length reserved (a bound on the file's) until the file is stored and counted
        return await _upload(request, owner, server, max_bytes)
    finally:
        server.in_flight.give_back(owner, int(length))


async def _upload(request: Request, owner: str, server: Served, max_bytes: int) -> Response:
    file_id = f"file-{secrets.token_hex(12)}"
    path = server.files_dir / f"{file_id}.jsonl"
    tmp = path.with_suffix(".upload")
    received = await receive_upload(request, tmp, max_bytes)
    purpose = received.fields.get("purpose")
    if purpose != "batch":
        tmp.unlink(missing_ok=True)
        raise ApiError(400, f"purpose must be 'batch' (got {purpose!r})", "invalid_value", "purpose")
    name = Path(received.filename).name or "upload.jsonl"  # NOTE: a name to show, never a path to use
    row = FileRow(file_id, owner, name[:255], "batch", received.size, int(time.time()), "")
    await run_in_threadpool(_keep_upload, server.state, tmp, path, row)
    return JSONResponse(file_object(row))


def _keep_upload(state: State, tmp: Path, path: Path, row: FileRow) -> None:
    tmp.replace(path)
    fsync_dir(path.parent)  # NOTE: the rename durable before a row of the state names the file
    state.add_file(row)


def list_files(request: Request, owner: str) -> Response:
    """OpenAI's file list: `purpose`, `limit` (1-10,000, all by default), `order` (desc: newest
    first, or asc) and `after` (the last id of the page before)."""
    query = request.query_params
    limit = page_limit(query.get("limit"), MOST_FILES_LISTED, MOST_FILES_LISTED)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", "invalid_value", "order")
    rows, more = served(request).state.files(owner, query.get("purpose"), query.get("after"), limit, order == "desc")
    data = [file_object(r) for r in rows]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})


def page_limit(given: str | None, default: int, most: int) -> int:
    if given is None:
        return default
    if not LIMIT.fullmatch(given) or not 1 <= int(given) <= most:
        raise ApiError(400, f"limit must be between 1 and {most:,}", "invalid_value", "limit")
    return int(given)


def get_file(request: Request, owner: str) -> Response:
    return JSONResponse(file_object(own_file(request, owner)))


def file_content(request: Request, owner: str) -> Response:
    row = own_file(request, owner)
    path = served(request).files_dir / f"{row.id}.jsonl"
    if not path.is_file():
        raise ApiError(404, f"{row.id} has no content any more", "file_not_found")
    return FileResponse(path, media_type="application/jsonl", filename=row.filename)


def delete_file(request: Request, owner: str) -> Response:
    server, row = served(request), own_file(request, owner)
    if not server.state.delete_file(row.id):
        # NOTE: 400, not 409: the client retries a 409
        raise ApiError(400, f"{row.id} is the input of a batch that has not ended; cancel it first", "file_in_use")
    (server.files_dir / f"{row.id}.jsonl").unlink(missing_ok=True)
    return JSONResponse({"id": row.id, "object": "file", "deleted": True})


async def json_body(request: Request) -> dict[str, Any]:
    """A create request's body: a JSON object of at most MAX_JSON_BYTES, sent as application/json
    (a form or text/plain body is what a cross-site page can send unasked), or a 400/413/415."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "the request body must be sent as Content-Type: application/json", "invalid_content_type")
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
    for name in ("input_file_id", "endpoint", "completion_window"):
        if body.get(name) is None:
            raise ApiError(400, f"Missing required parameter: '{name}'.", "missing_required_parameter", name)
    file_id = body["input_file_id"]
    valid = isinstance(file_id, str) and FILE_ID.fullmatch(file_id)
    file = await run_in_threadpool(server.state.file, file_id) if valid else None
    if file is None or file.owner != owner:
        raise ApiError(404, f"No such File object: {file_id}", param="input_file_id")
    if file.purpose != "batch":
        raise ApiError(400, f"{file_id} was not uploaded with purpose 'batch'", "invalid_value", "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in server.settings.endpoints:
        served_endpoints = ", ".join(server.settings.endpoints) or "none"
        message = f"endpoint {endpoint!r} is not served by this model (it serves {served_endpoints})"
        raise ApiError(400, message, "invalid_value", "endpoint")
    window = body["completion_window"]
    if window != COMPLETION_WINDOW:
        message = f"completion_window {window!r} is not supported: the only window is {COMPLETION_WINDOW!r}"
        raise ApiError(400, message, "invalid_value", "completion_window")
    metadata = body.get("metadata")
    priority = batch_priority(metadata)
    now = int(time.time())
    row = BatchRow(
        f"batch_{secrets.token_hex(12)}", owner, 0, file.id, endpoint, window, metadata, priority,
        "validating", now, now + COMPLETION_WINDOW_S,
    )  # fmt: skip
    if await run_in_threadpool(server.state.add_batch, row) is None:
        raise ApiError(404, f"No such File object: {file_id}", param="input_file_id")  # NOTE: deleted meanwhile
    server.runner.wake()
    return server.shown(row)


def get_batch(request: Request, owner: str) -> Response:
    return served(request).shown(own_batch(request, owner))


def list_batches(request: Request, owner: str) -> Response:
    server = served(request)
    limit = page_limit(request.query_params.get("limit"), 20, 100)
    rows, more = server.state.batches(owner, request.query_params.get("after"), limit)
    data = [batch_object(r, server.settings.model, server.runner.live_completed(r.id)) for r in rows]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})


def cancel_batch(request: Request, owner: str) -> Response:
    server, row = served(request), own_batch(request, owner)
    if row.status not in FINAL:
        row = server.runner.cancel(row.id) or row
    return server.shown(row)


def route(path: str, handler: Callable[[Request, str], Any], method: str) -> Route:
    """`handler` behind the Host and API key checks, its ApiError answered in OpenAI's error shape;
    a plain function runs in a worker thread."""
    blocking = not inspect.iscoroutinefunction(handler)

    async def endpoint(request: Request) -> Response:
        try:
            settings = served(request).settings
            check_host(request, settings.hosts)
            owner = owner_of(request, settings.api_keys)
            if blocking:
                return await run_in_threadpool(handler, request, owner)
            return await handler(request, owner)
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
    try:
        check_host(request, served(request).settings.hosts)
    except ApiError as refused:
        return refused.response()
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
