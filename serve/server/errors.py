"""The API's error shape and the exception -> status mapping: every error is
`{"error": {"message", "type", "param", "code"}}`, a 4xx naming the field for client errors, 5xx only for server
faults (the message names the exception type only: the traceback goes to the server log)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsteward.serve.engine.ops import OpsError
from kvsteward.serve.engine.session import CacheOpError
from kvsteward.serve.server.completions import Cancelled
from kvsteward.serve.server.store import CorruptSession, IdempotencyConflict, RebuildError, SessionNotFound


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


class BodyTooLarge(Exception):
    pass


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
    return (f"{loc}: {e.get('msg')}" if loc else str(e.get("msg"))), (loc or None)


def install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(OpsError)
    async def _ops(_, exc: OpsError):
        return error_response(400, str(exc), "invalid_request_error", exc.param, getattr(exc, "code", None))

    @app.exception_handler(CacheOpError)
    async def _cacheop(_, exc: CacheOpError):
        return error_response(400, f"cache operation refused: {exc}", "invalid_request_error", "cache")

    @app.exception_handler(SessionNotFound)
    async def _nosession(_, exc: SessionNotFound):
        return error_response(404, f"session {exc.args[0]!r} not found", "not_found_error", "session_id")

    @app.exception_handler(IdempotencyConflict)
    async def _idem(_, exc: IdempotencyConflict):
        return error_response(422, str(exc), "invalid_request_error", "Idempotency-Key", "idempotency_key_reused")

    @app.exception_handler(CorruptSession)
    async def _corrupt(_, exc: CorruptSession):
        return error_response(409, str(exc), "conflict_error", "session_id", "session_corrupt")

    @app.exception_handler(RebuildError)
    async def _rebuild(_, exc: RebuildError):
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(Cancelled)
    async def _gone(_, exc: Cancelled):  # nobody reads it: the status is for the access log and the metrics
        return error_response(499, "the client closed the connection: the request's work was cancelled",
                              "client_closed_request")

    @app.exception_handler(BodyTooLarge)
    async def _large(_, exc: BodyTooLarge):
        return error_response(413, str(exc), "request_too_large")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(400, msg, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):  # the router's 404 / 405
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of the path (the router names only its first matching route's)
            from starlette.routing import Match

            methods = set()
            for route in app.router.routes:
                match, _ = route.matches({**request.scope, "method": "GET"})
                if match != Match.NONE and getattr(route, "methods", None):
                    methods |= set(route.methods)
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", headers=headers or None)

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")
