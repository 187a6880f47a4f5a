"""What `hpcinfer serve` answers, in the shapes of the `openai` package's types: `FileObject`,
`Batch`, and OpenAI's error (`{"error": {"message", "type", "param", "code"}}`) with its status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse

from .state import BatchRow, FileRow


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JSONResponse:
        # NOTE: OpenAI types a wrong key `invalid_request_error` too (code `invalid_api_key`); 5xx are `server_error`
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


def file_object(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": row.created_at,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
    }


def shown_model(model: str) -> str:
    """The model as a batch names it: a packaged name as it is, a checkpoint by its folder or file
    name (never the server's path)."""
    return Path(model).name or model


def batch_object(row: BatchRow, model: str, live_completed: int | None = None) -> dict[str, Any]:
    """The `Batch` a client reads. Its metadata is the client's, plus what the server measured
    (`hpcinfer_waited_s`: from created to running; `hpcinfer_model_load_s`: loading the model for it,
    0.000 when it was kept loaded from an earlier batch)."""
    at = {f"{status}_at": row.times.get(status) for status in ("in_progress", "finalizing", "completed")}
    at |= {f"{status}_at": row.times.get(status) for status in ("failed", "expired", "cancelling", "cancelled")}
    completed = row.completed if live_completed is None else live_completed
    metadata = row.metadata
    if row.stats:
        metadata = {**(metadata or {}), **{f"hpcinfer_{name}": value for name, value in row.stats.items()}}
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "model": shown_model(model),
        "errors": {"object": "list", "data": row.errors} if row.errors else None,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": row.created_at,
        "expires_at": row.expires_at,
        **at,
        "request_counts": {"total": row.total, "completed": completed, "failed": row.failed},
        "metadata": metadata,
        "usage": row.usage,
    }
