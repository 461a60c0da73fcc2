"""The HTTP API (FastAPI): OpenAI-compatible chat completions with AKV cache ops, persistent sessions, metrics.

Endpoints: POST /v1/chat/completions, GET /v1/models, POST/GET /v1/sessions, GET/DELETE /v1/sessions/{id},
POST /v1/sessions/{id}/messages, GET /metrics, GET /health. Every error is
`{"error": {"message", "type", "param", "code"}}` with a 4xx status naming the problem (5xx only for server faults,
counted in the metrics like any other status); the server keeps serving after any of them. Handlers are sync (run in
the threadpool); one model forward at a time through a shared engine lock, a scheduler that gives main requests
priority over the aux memory-manager thread (`kvsteward.serve.manager`).

Access (outermost first): a Host allowlist (`allowed_hosts`), CORS (off unless `cors_origins`), bearer API keys
(`api_keys`: every path but /health; sessions belong to the key that created them), the body-size limit, and
POST bodies only as `application/json` (415 otherwise: no cross-origin "simple" request reaches a handler); the
middlewares live in `access.py`, body parsing and the OpenAPI request schemas in `bodies.py`, the error shape in
`errors.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from kvsteward.serve.engine.ops import OpsError, SessionSpec
from kvsteward.serve.manager.worker import AuxConfig, Scheduler
from kvsteward.serve.server.access import (
    LOOPBACK_HOSTS,
    ApiKeyAuth,
    BodyLimit,
    HostAllowlist,
    JsonOnly,
    is_loopback,
    key_owner,
    parse_api_keys,
    public_model_id,
)
from kvsteward.serve.server.bodies import (
    ChatCompletionRequest,
    SessionCreateRequest,
    SessionTurnRequest,
    body_doc,
    idempotency_key,
    install_openapi,
    json_body,
)
from kvsteward.serve.server.completions import (
    ChatService,
    ServeLimits,
    check_message_count,
    check_prompt_size,
    completion_id,
    prompt_token_count,
    usage,
)
from kvsteward.serve.server.errors import ApiError, error_response, install_errors
from kvsteward.serve.server.metrics import Metrics
from kvsteward.serve.server.store import SessionStore

# what callers import from here (the server's entry points; the pieces live in access / bodies / errors)
__all__ = ["LOOPBACK_HOSTS", "ApiError", "ServerConfig", "create_app", "error_response", "is_loopback", "key_owner",
           "make_spill", "make_tiers", "parse_api_keys", "public_model_id"]


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
    api_keys: dict[str, str] | None = None  # key -> owner name; None/empty: no authentication (loopback use)
    public_prompts: tuple[str, ...] = ()  # system prompts whose prefix-cache state every owner may share
    cors_origins: tuple[str, ...] = ()  # origins allowed by CORS (none: CORS off, browsers refuse cross-origin)
    allowed_hosts: tuple[str, ...] | None = None  # Host header allowlist (None: any host)


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


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware.cors import CORSMiddleware

    from kvsteward.paths import data_dir

    config = config or ServerConfig()
    if engine.tokenizer is None:
        raise ValueError("serving needs an engine with a tokenizer (chat template)")
    if config.aux is not None and config.aux.use_adapter and not engine.is_peft:
        raise ValueError("the aux thread is set to use the LoRA adapter, but the engine has none (load one with "
                         "Engine.load(..., adapter=DIR), or set use_adapter=False for the base model)")
    config.limits.validate()
    config = dataclasses.replace(config, limits=config.limits.for_model(engine))  # the default prompt limit
    metrics = Metrics()
    root = Path(config.data_dir) if config.data_dir is not None else data_dir()
    engine.spill = make_spill(config, root, metrics)
    lock = Scheduler(max_aux_wait=None if config.aux is None else config.aux.max_wait)
    chat = ChatService(engine, config.defaults, config.cache_bytes, config.limits, metrics, lock, config.checkpoints,
                       config.public_prompts)
    store = SessionStore(root / "sessions", engine, config.defaults, lock, metrics, config.session_bytes,
                         config.limits, aux=config.aux)
    if config.tiers:
        store.tiers = make_tiers(config, root, metrics, set(store.ids()))
    app = FastAPI(title="kvsteward", version="0.1.0")
    app.state.chat, app.state.store, app.state.metrics, app.state.config = chat, store, metrics, config
    app.state.scheduler = lock
    app.router.on_shutdown.append(store.close)
    # middleware: the last added runs first (outermost)
    app.add_middleware(JsonOnly)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_keys:
        app.add_middleware(ApiKeyAuth, keys=dict(config.api_keys))
    install_errors(app)
    install_openapi(app)

    @app.middleware("http")
    async def _observe(request: Request, call_next):
        t0 = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception:  # answered by the catch-all handler outside this middleware: a 500, counted here
            endpoint = getattr(request.scope.get("route"), "path", "unmatched")
            metrics.requests.labels(endpoint, "500").inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
            raise
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if not response.headers.get("content-type", "").startswith("text/event-stream"):  # streams time themselves
            metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        return response

    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST",
                           "DELETE"], allow_headers=["Authorization", "Content-Type", "Idempotency-Key"])
    if config.allowed_hosts is not None:
        app.add_middleware(HostAllowlist, allowed_hosts=list(config.allowed_hosts))

    def owner_of(request: Request) -> str | None:
        return getattr(request.state, "owner", None)

    def check_model(body: dict) -> None:
        model = body.get("model")
        if model is None:
            body["model"] = config.model_name
        elif not isinstance(model, str):
            raise ApiError(400, f"model must be a string naming the served model, got {type(model).__name__}",
                           param="model")
        elif model != config.model_name:
            raise ApiError(404, f"the model {model[:200]!r} does not exist: this server serves "
                                f"{config.model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    def check_turn_size(body: dict) -> None:
        """A session turn's new messages against max_messages / max_prompt_tokens (rendered alone: an upper bound
        of what they add; the whole history is checked against the model's positions by the store)."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return
        check_message_count(len(msgs), config.limits)
        if config.limits.max_prompt_tokens is None:
            return
        from kvsteward.serve.engine.ops import normalize_messages

        try:
            normal = normalize_messages(msgs)
        except OpsError:
            return  # the store refuses these messages with its own, precise error
        n = prompt_token_count(engine.tokenizer, normal, None, generation_prompt=False, limits=config.limits,
                               per_token=chat.per_token)
        check_prompt_size(engine, config.limits, n, 0, unbounded=False)

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

    @app.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
    async def chat_completions(request: Request):
        t0 = time.monotonic()
        body = await json_body(request)
        check_model(body)
        n = body.get("n", 1)
        if n != 1 or isinstance(n, bool):
            raise ApiError(400, "only n=1 is supported (decoding is greedy)", param="n")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise ApiError(400, f"stream must be true or false, got {type(stream).__name__}", param="stream")
        options = body.get("stream_options")
        if options is not None:
            if not isinstance(options, dict):
                raise ApiError(400, "stream_options must be an object {'include_usage': bool}",
                               param="stream_options")
            if not isinstance(options.get("include_usage", False), bool):
                raise ApiError(400, "stream_options.include_usage must be true or false",
                               param="stream_options.include_usage")
        if stream:
            return await _stream(request, body, t0)

        def work(cancel: threading.Event):
            with lock.main():
                return chat.complete(body, t0, owner_of(request), cancel)

        return await until_done_or_gone(request, work)

    async def until_done_or_gone(request: Request, work, *args, **kw):
        """`work(*args, cancel=event, **kw)` in the threadpool; the event is set once the client has disconnected,
        so the work stops at its next prefill chunk or decode step instead of running on for nobody (`Cancelled`,
        answered 499)."""
        cancel = threading.Event()

        async def watch() -> None:  # the body is read: the next message the server gives is the disconnect
            try:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # a server that cannot tell (nothing to cancel on): the work runs to its end
                return
            cancel.set()

        watcher = asyncio.ensure_future(watch())
        try:
            return await run_in_threadpool(work, *args, cancel=cancel, **kw)
        finally:
            watcher.cancel()

    async def _stream(request: Request, body: dict, t_arrival: float):
        t0 = time.perf_counter()
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))  # validated by the caller
        lock.begin_main()  # main work until the last byte (the aux thread waits meanwhile)
        once = threading.Lock()

        def end_main():  # once: from the stream's end, or the response's background task if it never started
            if once.acquire(blocking=False):
                lock.end_main()

        try:
            prep = await until_done_or_gone(request, chat.prepare, body, t_arrival,  # errors: a 4xx before any byte
                                            owner_of(request))
        except BaseException:
            end_main()
            raise
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
    @app.post("/v1/sessions", openapi_extra=body_doc(SessionCreateRequest))
    async def create_session(request: Request):
        body = await json_body(request)
        check_model(body)
        body.pop("model")
        rec = await run_in_threadpool(store.create, body, owner=owner_of(request))
        return {"id": rec.id, "object": "session", "created": rec.created, "config": rec.spec.as_json()}

    @app.get("/v1/sessions")
    def list_sessions(request: Request):
        return {"object": "list",
                "data": [{"id": sid, "object": "session"} for sid in store.ids(owner=owner_of(request))]}

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str, request: Request):
        with lock.main():  # a restore may run forwards
            rec = store.acquire(session_id, owner=owner_of(request))
            try:
                return rec.describe()
            finally:
                store.release(rec)

    @app.post("/v1/sessions/{session_id}/messages", openapi_extra=body_doc(SessionTurnRequest))
    async def session_messages(session_id: str, request: Request):
        key = idempotency_key(request)
        body = await json_body(request)
        check_model(body)
        body.pop("model")
        await run_in_threadpool(check_turn_size, body)  # tokenizing may take a while: not on the event loop
        return await until_done_or_gone(request, store.run_turn, session_id, body, owner=owner_of(request),
                                        idempotency_key=key)

    @app.delete("/v1/sessions/{session_id}")
    def delete_session(session_id: str, request: Request):
        store.delete(session_id, owner=owner_of(request))
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    return app
