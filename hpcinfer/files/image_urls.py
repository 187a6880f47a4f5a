"""An image a row names: a chat's `image_url` (a data URL, a path or a URI) or an image column's
value (a path, a URI or bytes), read into bytes with the same guards for both.

- An http(s) URL is refused (a job runs offline), as is any scheme that is not a file system of
  the storage layer (`file://`, S3, GCS, Azure, HDFS): fsspec knows others (ftp, sftp, memory, ...)
  that a row has no business naming.
- A local path must be a regular file (a FIFO would hang the run, a device like /dev/zero fill
  memory); a relative one is in its input file's folder.
- At most MAX_IMAGE_BYTES are read, whatever the source, a data URL's decoded bytes included.
- `files=False` (hpcinfer serve: the input is a tenant's upload) reads no file or URI at all: an
  image comes inline, as a data URL or Parquet bytes.
"""

from __future__ import annotations

import base64
import os
from typing import Any

from . import storage

MAX_IMAGE_BYTES = 64 << 20  # 64 MiB: a 100-megapixel JPEG is ~30 MB
STORE_SCHEMES = frozenset({"", "file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hdfs"})


class ImageRefused(ValueError):
    """The row's image cannot be had: `reason` is the reject's code, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def image_bytes(ref: Any, base: str = "", files: bool = True) -> bytes:
    """The bytes of the image `ref` names (a data URL, a path or URI, or bytes); `base`: the input
    file a relative path is beside; `files`: whether paths and URIs may be read at all."""
    if isinstance(ref, bytes | bytearray | memoryview):
        return _bounded(bytes(ref))
    if not isinstance(ref, str) or not ref.strip():
        raise ImageRefused("image_missing", "no image (an image is a data URL, a path, a URI or bytes)")
    if ref.startswith("data:"):
        head, sep, data = ref.partition(",")
        if not sep or ";base64" not in head:
            raise ImageRefused("image_unreadable", "an image data URL must be base64 (data:image/...;base64,...)")
        if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise ImageRefused("image_unreadable", f"the image data URL holds more than {MAX_IMAGE_BYTES >> 20} MiB")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise ImageRefused("image_unreadable", "the image data URL is not valid base64") from None
    scheme = storage.scheme(ref)
    if scheme in ("http", "https"):
        raise ImageRefused("image_remote", "an http(s) URL: images come from data URLs, files and object stores")
    if not files:
        raise ImageRefused("image_remote", "images come inline here (a data URL or bytes), not as paths or URIs")
    if scheme not in STORE_SCHEMES:
        raise ImageRefused("image_remote", f"a {scheme}:// URI: images come from files and object stores")
    path = ref
    if not scheme and not os.path.isabs(path) and base:
        if storage.is_remote(base):
            path = base.rsplit("/", 1)[0] + "/" + path
        else:
            path = os.path.join(os.path.dirname(storage.local_path(base)), path)
    shown = _shown(path)
    if not storage.is_remote(path):
        local = storage.local_path(path)
        if not os.path.exists(local):
            raise ImageRefused("image_missing", f"no image at {shown}")
        if not os.path.isfile(local):
            raise ImageRefused("image_missing", f"{shown} is not a regular file")
    try:
        with storage.open_binary(path) as f:
            return _bounded(f.read(MAX_IMAGE_BYTES + 1))
    except FileNotFoundError:
        raise ImageRefused("image_missing", f"no image at {shown}") from None
    except storage.errors() as exc:
        raise ImageRefused("image_missing", f"cannot read {shown} ({storage.failure(exc)})") from None


def _bounded(data: bytes) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRefused("image_unreadable", f"the image is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return data


def _shown(path: str) -> str:
    shown = storage.shown(path)
    return shown if len(shown) <= 200 else "..." + shown[-197:]
