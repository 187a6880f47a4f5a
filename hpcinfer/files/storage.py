"""Where a file lives: a local path, or a URI on an object store or a distributed file system.

`s3://`, `gs://`, `az://`/`abfs://`, `hdfs://` (and any protocol fsspec knows) are reached through
fsspec's filesystems (s3fs, gcsfs, adlfs, pyarrow's HDFS), which read credentials where each cloud's
own tools do: the environment, their config files, instance roles. `file://` is a local path.
What a run adds (an endpoint, a region: `--storage-options JSON`) is set once per process by
`configure`, before any file is opened; a Ray replica sets the same.

Errors name the URI as the user wrote it, less any `user:password@` part, and never the options:
credentials must not reach a terminal, a report or a manifest.
"""

from __future__ import annotations

import re
import threading
from typing import IO, Any

LOCAL_SCHEMES = ("", "file")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")

_lock = threading.Lock()
_options: dict[str, Any] = {}
_filesystems: dict[str, Any] = {}


def scheme(path: str) -> str:
    match = _SCHEME.match(path)
    return match.group(1).lower() if match else ""


def is_remote(path: str) -> bool:
    """A URI fsspec reaches (`s3://bucket/key`), not a local path (`file://` is local)."""
    return scheme(path) not in LOCAL_SCHEMES


def local_path(path: str) -> str:
    """`file:///data/x.jsonl` -> `/data/x.jsonl`; any other path as it is."""
    return path[len("file://") :] if scheme(path) == "file" else path


def shown(path: str) -> str:
    """The URI for messages: without a `user:password@` part, nor a query (a presigned URL's
    signature is a credential)."""
    if not is_remote(path):
        return path
    return _USERINFO.sub(r"\1", path).split("?", 1)[0]


def configure(options: dict[str, Any]) -> None:
    """Sets the options every later filesystem is made with (filesystems made before are dropped)."""
    global _options
    with _lock:
        if options != _options:
            _options = dict(options)
            _filesystems.clear()


def filesystem(path: str) -> tuple[Any, str]:
    """The fsspec filesystem of a URI and the path within it (`bucket/key`)."""
    import fsspec  # NOTE: imported on first use: a run on local files never needs it

    protocol = scheme(path)
    with _lock:
        fs = _filesystems.get(protocol)
        if fs is None:
            try:
                cls = fsspec.get_filesystem_class(protocol)
            except (ImportError, ValueError) as exc:
                raise StorageUnavailable(protocol, exc) from None
            # NOTE: listings are never cached: a manifest or lease another process just wrote must show
            fs = _filesystems[protocol] = cls(**{"use_listings_cache": False, **_options})
    return fs, fs._strip_protocol(path)


class StorageUnavailable(OSError):
    """No filesystem for the URI's protocol: its package is not installed, or fsspec knows no such protocol."""

    def __init__(self, protocol: str, cause: Exception) -> None:
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
        hint = f"; pip install 'hpcinfer[{extra[protocol]}]'" if protocol in extra else ""
        super().__init__(f"no filesystem for {protocol}:// ({str(cause).splitlines()[0]}){hint}")


def open_binary(path: str, block_size: int | None = None) -> IO[bytes]:
    """A file opened for reading bytes; an object is read in ranged requests of `block_size`, so
    memory stays bounded whatever the object's size."""
    if not is_remote(path):
        return open(local_path(path), "rb")
    fs, key = filesystem(path)
    kwargs = {"block_size": block_size} if block_size else {}
    return fs.open(key, "rb", **kwargs)


def size(path: str) -> int:
    if not is_remote(path):
        import os

        return os.path.getsize(local_path(path))
    fs, key = filesystem(path)
    return int(fs.size(key))


def errors() -> tuple[type[BaseException], ...]:
    """What a store's client raises: OSError (s3fs, gcsfs and adlfs translate most failures to it)
    and botocore's own errors (no credentials, no connection), which they let through."""
    import sys

    botocore = sys.modules.get("botocore.exceptions")
    return (OSError, botocore.BotoCoreError) if botocore is not None else (OSError,)


def expand(spec: str) -> list[str] | None:
    """A URI's files: those a glob matches, a directory's (prefix's) data files, or the object itself,
    as URIs; None when nothing is there."""
    fs, key = filesystem(spec)
    if any(ch in key for ch in "*?["):
        found = [p for p, info in fs.glob(key, detail=True).items() if info.get("type") == "file"]
    elif fs.isdir(key):
        found = [info["name"] for info in fs.ls(key, detail=True) if info.get("type") == "file"]
    elif fs.isfile(key):
        found = [key]
    else:
        return None
    return [fs.unstrip_protocol(p) for p in sorted(found)]


def failure(exc: BaseException) -> str:
    """What went wrong with a store, in a few words (never the options or a credential)."""
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    if "NoCredentialsError" in kinds or "PartialCredentialsError" in kinds:
        return "no credentials found (environment, config files or instance role)"
    if isinstance(exc, StorageUnavailable):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"no such bucket or object ({_first_line(exc)})"
    if isinstance(exc, PermissionError):
        return f"access denied ({_first_line(exc)})"
    if isinstance(exc, OSError):
        return exc.strerror or _first_line(exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


_QUERY = re.compile(r"(\w+://[^\s?'\"]*)\?[^\s'\"]*")


def _first_line(exc: BaseException) -> str:
    """The error's first line, any URL in it without its query (a presigned URL's signature)."""
    text = str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc) or type(exc).__name__
    return _QUERY.sub(r"\1", text.splitlines()[0])[:200]


__all__ = [
    "StorageUnavailable",
    "configure",
    "errors",
    "expand",
    "failure",
    "filesystem",
    "is_remote",
    "local_path",
    "open_binary",
    "scheme",
    "shown",
    "size",
]
