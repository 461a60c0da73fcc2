"""The HTTP API (FastAPI): OpenAI-compatible chat completions with AKV cache ops, persistent sessions, metrics.

Endpoints: POST /v1/chat/completions, GET /v1/models, POST/GET /v1/sessions, GET/DELETE /v1/sessions/{id},
POST /v1/sessions/{id}/messages, GET /metrics, GET /health. Every error is `{"error": {"message", "type", "param"}}`
with a 4xx status naming the problem (5xx only for server faults); the server keeps serving after any of them.
Handlers are sync (run in the threadpool); one model forward at a time through a shared engine lock, a scheduler
that gives main requests priority over the aux memory-manager thread (`kvsteward.serve.manager`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsteward.serve.engine.ops import OpsError, SessionSpec
from kvsteward.serve.engine.session import CacheOpError
from kvsteward.serve.manager.worker import AuxConfig, Scheduler
from kvsteward.serve.server.completions import ChatService, ServeLimits, completion_id, usage
from kvsteward.serve.server.metrics import Metrics
from kvsteward.serve.server.store import RebuildError, SessionNotFound, SessionStore


@dataclass
class ServerConfig:
    model_name: str = "kvsteward"
    defaults: SessionSpec = field(default_factory=SessionSpec)
    cache_bytes: int = 2 << 30  # prefix-cache states (LRU beyond this)
    session_bytes: int = 4 << 30  # loaded persistent sessions (idle ones unloaded beyond this)
    max_body_bytes: int = 8 << 20
    limits: ServeLimits = field(default_factory=ServeLimits)
    data_dir: Path | None = None  # sessions live in <data_dir>/sessions; default kvsteward.paths.data_dir()
    checkpoints: bool = True
    aux: AuxConfig | None = None  # the aux memory-manager thread (None: off)
    tiers: bool = True  # unloaded sessions go down the storage tiers (False: dropped, rebuilt from the log)
    host_tier_bytes: int = 2 << 30  # snapshots in host memory (older ones move to disk beyond)
    disk_tier_bytes: int | None = 64 << 30  # snapshots in <data_dir>/tiers (None: unbounded; beyond: Valkey/delete)
    valkey_url: str | None = None  # a Valkey/Redis tier below disk (unbounded here: Valkey's maxmemory rules)
    spill_tier: str = "host"  # where tiered arms (pace-tiered) keep evicted planned spans: host | disk | valkey


def make_spill(config: ServerConfig, root: Path, metrics):
    """The spill store of tiered arms, in the configured tier; blobs a previous run left on disk are orphans (their
    sessions rebuild by replay, which spills again) and are removed."""
    from kvsteward.serve.engine.spill import SpillStore
    from kvsteward.serve.engine.tiers import DiskTier, HostTier, ValkeyTier

    if config.spill_tier == "host":
        tier = HostTier()
    elif config.spill_tier == "disk":
        tier = DiskTier(root / "spill")
        for path in list(tier.root.glob("*.kvstate")) + list(tier.root.glob("*.tmp")):
            path.unlink(missing_ok=True)
    elif config.spill_tier == "valkey":
        if not config.valkey_url:
            raise ValueError("spill tier 'valkey' needs a valkey_url")
        tier = ValkeyTier(config.valkey_url, prefix="kvsteward:spill:")
    else:
        raise ValueError(f"unknown spill tier {config.spill_tier!r}: host, disk or valkey")

    def observed(tier_name: str, seconds: float, tokens: int) -> None:
        metrics.rehydrated_tokens.inc(tokens)
        metrics.rehydrate_seconds.labels(tier_name).observe(seconds)

    store = SpillStore(tier, on_fetch=observed)
    metrics.spill_bytes.set_function(lambda: store.stats.bytes_held)
    return store


def make_tiers(config: ServerConfig, root: Path, metrics, known: set[str]):
    """The server's SessionTiers (host → disk [→ Valkey]); disk blobs of known sessions left by an earlier run are
    adopted (they are used only if their history matches the log), others removed."""
    from kvsteward.serve.engine.tiers import DiskTier, HostTier, SessionTiers, ValkeyTier

    tiers, budgets = [HostTier(), DiskTier(root / "tiers")], [config.host_tier_bytes, config.disk_tier_bytes]
    if config.valkey_url:
        tiers.append(ValkeyTier(config.valkey_url))
        budgets.append(None)
    st = SessionTiers(tiers, budgets, metrics)
    for path in sorted(tiers[1].root.glob("*.kvstate"), key=lambda p: p.stat().st_mtime):
        if path.stem in known:
            st.adopt(path.stem, 1, path.stat().st_size)
        else:
            path.unlink(missing_ok=True)
    for path in tiers[1].root.glob("*.tmp"):  # a put killed before its rename
        path.unlink(missing_ok=True)
    return st


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


class BodyTooLarge(Exception):
    pass


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": None}}, status)


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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
    return (f"{loc}: {e.get('msg')}" if loc else str(e.get("msg"))), (loc or None)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(OpsError)
    async def _ops(_, exc: OpsError):
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(CacheOpError)
    async def _cacheop(_, exc: CacheOpError):
        return error_response(400, f"cache operation refused: {exc}", "invalid_request_error", "cache")

    @app.exception_handler(SessionNotFound)
    async def _nosession(_, exc: SessionNotFound):
        return error_response(404, f"session {exc.args[0]!r} not found", "not_found_error", "session_id")

    @app.exception_handler(RebuildError)
    async def _rebuild(_, exc: RebuildError):
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(BodyTooLarge)
    async def _large(_, exc: BodyTooLarge):
        return error_response(413, str(exc), "request_too_large")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(400, msg, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    from kvsteward.paths import data_dir

    config = config or ServerConfig()
    if engine.tokenizer is None:
        raise ValueError("serving needs an engine with a tokenizer (chat template)")
    if config.aux is not None and config.aux.use_adapter and not engine.is_peft:
        raise ValueError("the aux thread is set to use the LoRA adapter, but the engine has none (load one with "
                         "Engine.load(..., adapter=DIR), or set use_adapter=False for the base model)")
    metrics = Metrics()
    root = Path(config.data_dir) if config.data_dir is not None else data_dir()
    engine.spill = make_spill(config, root, metrics)
    lock = Scheduler(max_aux_wait=None if config.aux is None else config.aux.max_wait)
    chat = ChatService(engine, config.defaults, config.cache_bytes, config.limits, metrics, lock, config.checkpoints)
    store = SessionStore(root / "sessions", engine, config.defaults, lock, metrics, config.session_bytes,
                         config.limits, aux=config.aux)
    if config.tiers:
        store.tiers = make_tiers(config, root, metrics, set(store.ids()))
    app = FastAPI(title="kvsteward", version="0.1.0")
    app.state.chat, app.state.store, app.state.metrics, app.state.config = chat, store, metrics, config
    app.state.scheduler = lock
    app.router.on_shutdown.append(store.close)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    _install_errors(app)

    @app.middleware("http")
    async def _observe(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if not response.headers.get("content-type", "").startswith("text/event-stream"):  # streams time themselves
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return response

    @app.get("/health")
    def health():
        return {"status": "ok", "model": config.model_name}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvsteward"}]}

    @app.get("/metrics")
    def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        body.setdefault("model", config.model_name)
        n = body.get("n", 1)
        if n != 1:
            raise ApiError(400, "only n=1 is supported (decoding is greedy)", param="n")
        if body.get("stream"):
            return await _stream(body)
        from starlette.concurrency import run_in_threadpool

        def work():
            with lock.main():
                return chat.complete(body)

        return await run_in_threadpool(work)

    async def _stream(body: dict):
        from starlette.concurrency import run_in_threadpool

        t0 = time.perf_counter()
        lock.begin_main()  # main work until the last byte (the aux thread waits meanwhile)
        once = threading.Lock()

        def end_main():  # once: from the stream's end, or the response's background task if it never started
            if once.acquire(blocking=False):
                lock.end_main()

        try:
            prep = await run_in_threadpool(chat.prepare, body)  # errors surface here, as a 4xx before any byte
        except BaseException:
            end_main()
            raise
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        cid, created, model = completion_id(), int(time.time()), body["model"]

        def chunk(delta: dict, finish: str | None, **extra) -> str:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(obj)}\n\n"

        def events():
            try:
                yield chunk({"role": "assistant", "content": ""}, None)
                for piece in prep.decoder:
                    yield chunk({"content": piece}, None)
                metrics.generated_tokens.inc(len(prep.decoder.tokens))
                yield chunk({}, prep.decoder.finish_reason, kvsteward=prep.info)
                if include_usage:
                    obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": usage(prep)}
                    yield f"data: {json.dumps(obj)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                end_main()
                metrics.latency.labels("/v1/chat/completions").observe(time.perf_counter() - t0)

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(end_main))

    # -- persistent sessions ----------------------------------------------------------------------------------------
    @app.post("/v1/sessions")
    async def create_session(request: Request):
        from starlette.concurrency import run_in_threadpool

        body = await _json_body(request)
        rec = await run_in_threadpool(store.create, body)
        return {"id": rec.id, "object": "session", "created": rec.created, "config": rec.spec.as_json()}

    @app.get("/v1/sessions")
    def list_sessions():
        return {"object": "list", "data": [{"id": sid, "object": "session"} for sid in store.ids()]}

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str):
        with lock.main():  # a restore may run forwards
            rec = store.acquire(session_id)
            try:
                return rec.describe()
            finally:
                store.release(rec)

    @app.post("/v1/sessions/{session_id}/messages")
    async def session_messages(session_id: str, request: Request):
        from starlette.concurrency import run_in_threadpool

        body = await _json_body(request)
        return await run_in_threadpool(store.run_turn, session_id, body)

    @app.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str):
        store.delete(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    return app
