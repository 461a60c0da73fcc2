"""Who may reach the API: API keys and their owners, the Host allowlist, and the body rules (size, JSON only).

Middlewares, each a plain ASGI wrapper answering in the API's error shape (`errors.error_response`): `HostAllowlist`
(starlette's TrustedHostMiddleware), `ApiKeyAuth` (bearer keys, the owner name in `request.state.owner`),
`BodyLimit` (413 beyond the limit, also for chunked bodies) and `JsonOnly` (415 for any non-JSON POST body, so a
browser's cross-origin "simple" request never reaches a handler)."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from kvsteward.serve.server.errors import BodyTooLarge, error_response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")  # starlette reads "[::1]:port" as "[::1]"


def key_owner(key: str) -> str:
    """The owner name of a bare API key: a sha256 prefix (the raw key is never stored or logged)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_api_keys(keys: list[str] | tuple[str, ...] = (), files: list[Path] | tuple[Path, ...] = ()) -> dict:
    """key -> owner name from bare keys (owner: `key_owner`) and key files: one `name:key` or bare key a line,
    `#` starts a comment, blank lines are skipped. A key listed twice under different names is an error."""
    out: dict[str, str] = {}

    def add(key: str, owner: str, where: str) -> None:
        if not key or any(c.isspace() for c in key) or not key.isascii() or not key.isprintable():
            raise ValueError(f"{where}: an API key must be printable ASCII without spaces")
        if key in out and out[key] != owner:
            raise ValueError(f"{where}: this key is already listed as {out[key]!r}")
        out[key] = owner

    for k in keys:
        add(k, key_owner(k), "--api-key")
    for path in files:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, key = line.partition(":")
            name, key = (name.strip(), key.strip()) if sep else (None, line)
            if sep and not name:
                raise ValueError(f"{path}:{n}: empty name before ':'")
            add(key, name or key_owner(key), f"{path}:{n}")
    return out


def is_loopback(host: str) -> bool:
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def public_model_id(model: str) -> str:
    """The id a server publishes for `--model`: a local folder by its name (never its filesystem path)."""
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve().name or "model"
    return model


class BodyLimit:
    """Refuse bodies over `max_bytes`: at once from Content-Length, or while reading a chunked body."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            resp = error_response(413, f"request body of {int(length)} bytes exceeds the limit of {self.max_bytes}",
                                  "request_too_large")
            return await resp(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(f"request body exceeds the limit of {self.max_bytes} bytes")
            return msg

        return await self.app(scope, limited, send)


class JsonOnly:
    """POST/PUT/PATCH bodies must be `application/json` (415 otherwise): a browser's cross-origin "simple" request
    (text/plain, form data) never reaches a handler, with or without CORS."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = dict(scope.get("headers") or []).get(b"content-type", b"").decode("latin-1")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                resp = error_response(415, f"request bodies must be application/json, got {ctype or 'none'!r}",
                                      "invalid_request_error", "Content-Type")
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class HostAllowlist:
    """starlette's TrustedHostMiddleware (its matching: exact names, `*.domain`, `*`), refusing in this API's error
    shape: 400 naming `Host`."""

    def __init__(self, app, allowed_hosts: list[str]):
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        async def admitted(scope, receive, send):
            scope["kvsteward.host_ok"] = True
            await app(scope, receive, send)

        self.inner = TrustedHostMiddleware(admitted, allowed_hosts=allowed_hosts, www_redirect=False)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        refused = False

        async def guarded(message):
            nonlocal refused
            if scope.get("kvsteward.host_ok"):
                return await send(message)
            refused = True  # the middleware's plain-text refusal: replaced below

        await self.inner(scope, receive, guarded)
        if refused:
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            await error_response(400, f"Host {host[:100]!r} is not served here (allowed: --allowed-host)",
                                 "invalid_request_error", "Host")(scope, receive, send)


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on every path but `open_paths`; the key's owner name goes to
    `request.state.owner` (sessions are owned by it)."""

    def __init__(self, app, keys: dict[str, str], open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.open_paths = app, open_paths
        self.keys = [(k.encode(), owner) for k, owner in keys.items()]

    def owner(self, header: str | None) -> str | None:
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        token_b = token.strip().encode("utf-8", "replace")
        found = None
        for key, owner in self.keys:  # every key compared in constant time
            if hmac.compare_digest(key, token_b):
                found = owner
        return found

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization")
        owner = self.owner(None if header is None else header.decode("latin-1"))
        if owner is None:
            given = header is not None
            resp = error_response(
                401, "invalid API key" if given else "missing API key: send 'Authorization: Bearer <key>'",
                "authentication_error", None, "invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"' if given else "Bearer"})
            return await resp(scope, receive, send)
        scope.setdefault("state", {})["owner"] = owner
        return await self.app(scope, receive, send)
