"""What the reader makes of one row's values: the parsed rows of a chunk, and the checks that turn a
bad text, token list, prompt or id into a reject reason instead of a failed run."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .ids import is_unicode


class Rows:
    """Parsed rows of one chunk: per-row payload or reject, plus ids and line numbers."""

    def __init__(self) -> None:
        self.payloads: list[Any] = []  # str, list[int], a text pair, an OpenAI-style Request or a reject
        self.ids: list[Any] = []
        self.lines: list[int | None] = []
        self.prompts: list[str | None] | None = None  # with --prompt-column: each row's, or None


def check_text(value: Any, *, from_arrow: bool = False) -> tuple[str, str] | None:
    if value is None:
        return "missing_text", "no text"
    if not isinstance(value, str):
        return "wrong_type", f"text is a {type(value).__name__}, not a string"
    if not value or value.isspace():
        return "empty_text", "text is empty or whitespace"
    if not from_arrow and not is_unicode(value):  # NOTE: Arrow strings are UTF-8: no surrogates there
        return "invalid_unicode", "text holds a lone surrogate (e.g. an escaped \\ud800), not valid Unicode"
    return None


def check_image(value: Any) -> tuple[str, str] | None:
    """An image reference's type: a path or URI, or bytes (what may be read of it is
    files/image_urls.py's to say, when the decode stage reads it)."""
    if value is None:
        return "image_missing", "no image"
    if isinstance(value, bytes | bytearray):
        return None if value else ("image_unreadable", "the image's bytes are empty")
    if not isinstance(value, str):
        return "wrong_type", f"an image is a path, a URI or bytes, not a {type(value).__name__}"
    if not value.strip():
        return "image_missing", "the image's path is empty"
    return None


def pair_payload(first: Any, second: Any, names: tuple[str, ...]) -> Any:
    """A row's text pair as [first, second], or the reject of its first bad side (named)."""
    for value, name in zip((first, second), names, strict=True):
        if (bad := check_text(value)) is not None:
            return bad[0], f"{name}: {bad[1]}"
    return [first, second]


def check_tokens(value: Any) -> tuple[str, str] | None:
    if value is None:
        return "missing_text", "no input_ids"
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "wrong_type", "input_ids must be a list of integers"
    if not value:
        return "empty_text", "input_ids is empty"
    return None


def duplicate_reason(row_id: Any) -> tuple[str, str]:
    return "duplicate_id", f"id {row_id!r} appeared before"


def decoded_strings(values: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """Dictionary-encoded and view strings as plain ones."""
    kind = values.type
    if pa.types.is_dictionary(kind) or pa.types.is_string_view(kind):
        target = kind.value_type if pa.types.is_dictionary(kind) else pa.string()
        if pa.types.is_string_view(target):
            target = pa.string()
        return values.cast(target)
    return values


def check_prompts(rows: Rows) -> None:
    """A row whose prompt is neither text nor null is a reject; its payload says why."""
    assert rows.prompts is not None
    for k, prompt in enumerate(rows.prompts):
        if prompt is not None and not isinstance(prompt, str):
            rows.prompts[k] = None
            if not isinstance(rows.payloads[k], tuple):
                rows.payloads[k] = ("invalid_prompt", f"the prompt column holds {type(prompt).__name__}, not text")


def arrow_texts(values: pa.ChunkedArray | pa.Array) -> list[Any]:
    """Texts as Python strings, with null, blank and invalid ones replaced by reject reasons."""
    values = decoded_strings(values)
    try:
        texts = values.to_pylist()
    except UnicodeDecodeError:  # a Parquet writer stored bytes that are not UTF-8: find the rows
        texts = [utf8_or_reject(raw) for raw in values.cast(pa.binary()).to_pylist()]
    return [t if isinstance(t, tuple) or (bad := check_text(t, from_arrow=True)) is None else bad for t in texts]


def utf8_or_reject(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return "invalid_utf8", f"not UTF-8 ({exc.reason} at byte {exc.start})"


def arrow_ids(values: pa.ChunkedArray | pa.Array) -> list[Any]:
    values = decoded_strings(values)
    try:
        return values.to_pylist()
    except UnicodeDecodeError:  # an id that is not UTF-8 stays bytes, which check_id turns away
        return [
            raw if raw is None or isinstance(utf8_or_reject(raw), tuple) else raw.decode("utf-8")
            for raw in values.cast(pa.binary()).to_pylist()
        ]
