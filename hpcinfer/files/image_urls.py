"""A chat's `image_url`: the image's bytes from a data URL, a local path or an object-store URI."""

from __future__ import annotations

import base64
import os
from typing import Any

from . import storage


def image_bytes(url: Any, base: str = "") -> bytes:
    """An `image_url` part's image: a data URL (base64), a local path or `file://` URI, or an
    object-store URI; an http(s) URL is refused (a job runs offline)."""
    if not isinstance(url, str) or not url:
        raise ValueError("an image_url part needs its url")
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or ";base64" not in head:
            raise ValueError("an image data URL must be base64 (data:image/...;base64,...)")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise ValueError("the image data URL is not valid base64") from None
    if url[:8].lower().startswith(("http://", "https://")):
        raise ValueError("an http(s) image URL: images are read from data URLs, files and object stores (offline)")
    path = url
    if not storage.scheme(path) and not os.path.isabs(path) and base:
        path = os.path.join(os.path.dirname(storage.local_path(base)), path)
    try:
        with storage.open_binary(path) as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"no image at {storage.shown(path)}") from None
    except storage.errors() as exc:
        raise ValueError(f"cannot read the image {storage.shown(path)} ({storage.failure(exc)})") from None
