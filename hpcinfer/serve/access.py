"""Who may ask, and from where: the Host header against the bound address (DNS rebinding), the API
key as a Bearer token (the owner is its SHA-256, never the key), compared in constant time."""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from .objects import ApiError


def check_host(request: Request, hosts: frozenset[str] | None) -> None:
    """A Host header naming the bound host, or a 400: a browser page that resolves its own name to
    127.0.0.1 (DNS rebinding) sends that name, and is refused."""
    if hosts is None:
        return
    given = request.headers.get("host", "").lower()
    name = given[: given.find("]") + 1] if given.startswith("[") else given.rsplit(":", 1)[0]  # NOTE: [::1]:8000
    if name not in hosts:
        raise ApiError(400, f"Host {given[:100]!r} is not this server's; use the address it listens on", "invalid_host")


def owner_of(request: Request, api_keys: tuple[str, ...]) -> str:
    """Who is asking: the hash of their API key ("" on an open server), or a 401."""
    if not api_keys:
        if request.method != "GET" and "authorization" not in request.headers:
            # NOTE: --no-auth: a web page can POST a form to a loopback server unasked, but cannot add
            # this header without a CORS preflight this server never grants; every API client sends one
            raise ApiError(401, "send an Authorization header (any value on a --no-auth server)", "invalid_api_key")
        return ""
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    # NOTE: every key compared, in constant time each: which one matched takes no longer to find
    matched = [hmac.compare_digest(token.encode(), key.encode()) for key in api_keys]
    if not any(matched):
        raise ApiError(401, "Incorrect API key provided.", "invalid_api_key")
    return hashlib.sha256(token.encode()).hexdigest()
