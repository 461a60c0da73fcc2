"""`steward serve`: the HTTP server (OpenAI-compatible chat completions with AKV cache ops, persistent sessions,
Prometheus metrics). Mount with `app.add_typer(cli_serve.app, name="serve")`; also runnable as
`python -m kvsteward.pipelines.cli_serve --model ...`."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Serve a model over HTTP (OpenAI-compatible + AKV cache ops + persistent sessions).")
console = Console(stderr=True)


@app.callback(invoke_without_command=True)
def serve(model: str = typer.Option("smollm2", help="`smollm2` (embedded), a local HF folder, or a hub id"),
          host: str = typer.Option("127.0.0.1", help="bind address"),
          port: int = typer.Option(8000, help="TCP port"),
          policy: str = typer.Option("full", help="default policy / arm for requests that name none"),
          budget: int = typer.Option(None, help="default budget B (evicting policies)"),
          limit: int = typer.Option(None, help="default bounded-position limit L"),
          chunk: int = typer.Option(512, help="prefill chunk H"),
          max_body_bytes: int = typer.Option(8 << 20, help="largest accepted request body (413 beyond)"),
          cache_bytes: int = typer.Option(2 << 30, help="prefix-cache memory (LRU eviction beyond)"),
          session_bytes: int = typer.Option(4 << 30, help="memory of loaded sessions (idle ones unload beyond)"),
          max_tokens: int = typer.Option(256, help="default max_tokens of a reply"),
          max_tokens_limit: int = typer.Option(4096, help="largest max_tokens a request may ask for"),
          data_dir: Path = typer.Option(None, help="where sessions persist (default: $KVSTEWARD_HOME)"),
          dtype: str = typer.Option("float32", help="model dtype: float32 | bfloat16 | float16"),
          adapter: Path = typer.Option(None, help="PEFT LoRA folder of the learned memory manager (aux thread)"),
          aux_every: int = typer.Option(None, help="run the aux thread at every K-th tool response of a session "
                                                   "(default 4 with --adapter or --aux-base; off otherwise)"),
          aux_base: bool = typer.Option(False, help="run the aux thread with the base model (no adapter; testing)"),
          manager: Path = typer.Option(None, help="a manager folder from `steward eval choose` (a pipeline's "
                                                  "`choose` stage): serve its validation winner — the adapter as "
                                                  "--adapter serves it, or a fitted rule (no model forward)"),
          aux_max_tokens: int = typer.Option(48, help="decode budget of one aux decision"),
          aux_plan: bool = typer.Option(False, help="the aux thread also runs `Planning mode` at each fork; its plan "
                                                    "becomes the session's blueprint (foresight arms: pace, "
                                                    "retention-only, foresight)"),
          aux_plan_max_tokens: int = typer.Option(128, help="decode budget of one aux plan"),
          aux_max_wait: float = typer.Option(None, help="starvation bound (s): an aux step that waited this long "
                                                        "for main work runs between two main forwards (default: "
                                                        "the aux runs only in idle time)"),
          aux_close_bias: float = typer.Option(None, help="nats added to closing the aux deletion list: > 0 deletes "
                                                          "less and more surely (fewer harmful deletions); default: "
                                                          "the adapter's calibrated bias (`steward eval calibrate`), "
                                                          "0 without one"),
          aux_min_confidence: float = typer.Option(None, help="delete only the ids the aux lists with at least this "
                                                              "probability (a decode over its branches; 0: the "
                                                              "greedy list); default: the adapter's calibrated rule "
                                                              "(`steward eval calibrate --confidences`), greedy "
                                                              "without one"),
          aux_delete_unread: bool = typer.Option(False, "--aux-delete-unread",
                                                 help="let the aux delete tool responses the agent has not read yet "
                                                      "(default: never; the step after a boundary reads them)"),
          aux_context: str = typer.Option(None, help="what the aux trigger follows: full (the session) or first "
                                                     "(its first message only; constant cost per decision); "
                                                     "default: as the adapter was trained (its kvsteward.json)"),
          aux_head_tokens: int = typer.Option(8192, help="with --aux-context first: prefilled first messages kept "
                                                         "for the aux thread, in tokens (LRU; 0: none kept, each "
                                                         "decision prefills its own)"),
          tiers: bool = typer.Option(True, help="unloaded sessions go down host → disk (→ Valkey) tiers"),
          host_tier_bytes: int = typer.Option(2 << 30, help="snapshots kept in host memory (older → disk)"),
          disk_tier_bytes: int = typer.Option(64 << 30, help="snapshots kept on disk (older → Valkey, or deleted)"),
          valkey_url: str = typer.Option(None, help="valkey://host:port/db: a remote tier below disk"),
          spill_tier: str = typer.Option("host", help="where pace-tiered sessions keep evicted planned spans until "
                                                      "their reader step: host | disk | valkey (needs --valkey-url)"),
          served_model_name: str = typer.Option(None, help="the model id clients see and send (default: --model, or "
                                                           "its folder name when it is a local path)"),
          api_key: list[str] = typer.Option(None, "--api-key", help="an accepted bearer key (repeatable); with any "
                                                                    "key configured every path but /health needs "
                                                                    "'Authorization: Bearer <key>'"),
          api_keys_file: Path = typer.Option(None, help="accepted keys, one a line: 'name:key' or a bare key; '#' "
                                                        "comments"),
          public_system_prompts: Path = typer.Option(None, help="a JSON list of system prompts declared public: "
                                                                "with API keys, the prefix-cache state of a "
                                                                "conversation opening with one of them is shared by "
                                                                "every key (default: none: each key's cache is its "
                                                                "own)"),
          insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth",
                                                help="allow a non-loopback --host without any API key"),
          cors_origin: list[str] = typer.Option(None, "--cors-origin", help="an origin browsers may call from "
                                                                            "(repeatable; default: CORS off)"),
          allowed_host: list[str] = typer.Option(None, "--allowed-host",
                                                 help="a Host header value to accept (repeatable; '*' any; default: "
                                                      "loopback names on a loopback --host, any otherwise)"),
          max_messages: int = typer.Option(1024, help="most messages in one request (400 beyond)"),
          max_prompt_tokens: int = typer.Option(None, help="most prompt tokens in one request (400 beyond; "
                                                           "default: the model's positions)"),
          request_timeout: float = typer.Option(None, help="seconds a request may take: decoding stops once spent "
                                                           "(finish_reason 'length'); default: none"),
          limit_concurrency: int = typer.Option(64, help="open connections + tasks before uvicorn answers 503"),
          timeout_keep_alive: int = typer.Option(5, help="seconds an idle keep-alive connection stays open"),
          max_header_bytes: int = typer.Option(16384, help="largest request head (request line + headers) "
                                                           "accepted by the h11 parser (414 for a longer request "
                                                           "line, 431 for longer headers)"),
          log_level: str = typer.Option("info", help="uvicorn log level")) -> None:
    """Load the model once and serve it until interrupted."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import uvicorn

    from kvsteward.serve.engine import Engine
    from kvsteward.serve.engine.ops import OpsError, SessionSpec, session_spec
    from kvsteward.serve.manager.worker import AuxConfig
    from kvsteward.serve.server.api import (
        LOOPBACK_HOSTS,
        ServerConfig,
        create_app,
        is_loopback,
        parse_api_keys,
        public_model_id,
    )
    from kvsteward.serve.server.completions import ServeLimits
    from kvsteward.synth.traces.hindsight import check_aux_context

    try:
        keys = parse_api_keys(api_key or (), [api_keys_file] if api_keys_file is not None else ())
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e)) from e
    if not is_loopback(host) and not keys and not insecure_no_auth:
        raise typer.BadParameter(f"--host {host} is reachable from other machines, and no API key is configured: "
                                 "give --api-key / --api-keys-file (or --insecure-no-auth to serve without keys)")
    try:
        public = read_public_prompts(public_system_prompts)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--public-system-prompts: {e}") from e
    limits = ServeLimits(max_tokens_default=max_tokens, max_tokens_limit=max_tokens_limit, max_messages=max_messages,
                         max_prompt_tokens=max_prompt_tokens, request_timeout=request_timeout)
    try:
        limits.validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    for flag, v in (("--limit-concurrency", limit_concurrency), ("--timeout-keep-alive", timeout_keep_alive),
                    ("--max-header-bytes", max_header_bytes)):
        if v < 1:
            raise typer.BadParameter(f"{flag} must be >= 1, got {v}")
    hosts = tuple(allowed_host) if allowed_host else (LOOPBACK_HOSTS if is_loopback(host) else None)

    if adapter is not None and aux_base:
        raise typer.BadParameter("--adapter and --aux-base exclude each other: the manager is one model")
    rule = None
    if manager is not None:
        from kvsteward.serve.manager.rule import ManagerError, load_choice

        if adapter is not None or aux_base:
            raise typer.BadParameter("--manager names the manager itself: it excludes --adapter and --aux-base")
        try:
            choice = load_choice(manager)
        except ManagerError as e:
            raise typer.BadParameter(f"--manager: {e}") from e
        rule = choice.rule
        adapter = Path(choice.adapter_dir) if choice.serves_adapter else None
        if rule is not None:
            model_only = {"--aux-close-bias": aux_close_bias is not None, "--aux-min-confidence":
                          aux_min_confidence is not None, "--aux-context": aux_context is not None,
                          "--aux-plan": aux_plan, "--aux-delete-unread": aux_delete_unread}
            if bad := [flag for flag, on in model_only.items() if on]:
                raise typer.BadParameter(f"{', '.join(bad)}: the manager in {manager} is the fitted rule "
                                         f"{rule.name!r}, which decodes nothing and decides on read responses only")
    if rule is not None and adapter is None:
        aux_base = True  # (below: "a manager is configured"; the rule decides, the model is never asked)
    if aux_every is not None and adapter is None and not aux_base:
        raise typer.BadParameter("--aux-every needs a manager: --adapter DIR (or --aux-base for the base model)")
    if spill_tier not in ("host", "disk", "valkey") or (spill_tier == "valkey" and not valkey_url):
        raise typer.BadParameter(f"--spill-tier must be host, disk or valkey (valkey needs --valkey-url), "
                                 f"got {spill_tier!r}")
    if aux_max_wait is not None and adapter is None and not aux_base:
        raise typer.BadParameter("--aux-max-wait needs a manager: --adapter DIR (or --aux-base for the base model)")
    for flag, on in (("--aux-close-bias", aux_close_bias), ("--aux-delete-unread", aux_delete_unread),
                     ("--aux-min-confidence", aux_min_confidence is not None)):
        if on and adapter is None and not aux_base:
            raise typer.BadParameter(f"{flag} needs a manager: --adapter DIR (or --aux-base for the base model)")
    if aux_context is not None and adapter is None and not aux_base:
        raise typer.BadParameter("--aux-context needs a manager: --adapter DIR (or --aux-base for the base model)")
    if aux_context is not None:
        try:
            check_aux_context(aux_context, "--aux-context")
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
    if aux_plan and adapter is None and not aux_base:
        raise typer.BadParameter("--aux-plan needs a planner: --adapter DIR (or --aux-base for the base model)")
    aux = None
    if aux_head_tokens < 0:
        raise typer.BadParameter(f"--aux-head-tokens must be >= 0, got {aux_head_tokens}")
    if adapter is not None or aux_base:
        aux = AuxConfig(every=4 if aux_every is None else aux_every, max_tokens=aux_max_tokens,
                        use_adapter=adapter is not None, plan=aux_plan, plan_max_tokens=aux_plan_max_tokens,
                        max_wait=aux_max_wait, close_bias=0.0 if aux_close_bias is None else aux_close_bias,
                        keep_unread=not aux_delete_unread,
                        min_confidence=aux_min_confidence or None, rule=rule)  # 0: the greedy list
        try:
            aux.validate()
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
    with console.status(f"loading {model} ..."):
        engine = Engine.load(model, dtype=getattr(torch, dtype), adapter=None if adapter is None else str(adapter))
    if aux_context is not None:
        engine.aux_context = aux_context
    engine.aux_head_tokens = aux_head_tokens
    if aux is not None and aux_close_bias is None:
        aux.close_bias = engine.close_bias  # as calibrated for this adapter (0 for none)
    if aux is not None and aux_min_confidence is None:
        aux.min_confidence = engine.min_confidence  # as calibrated for this adapter (None: greedy)
    try:
        defaults = session_spec(engine, SessionSpec(chunk=chunk), policy, budget, limit)
    except OpsError as e:
        raise typer.BadParameter(str(e)) from e
    name = served_model_name or public_model_id(model)
    config = ServerConfig(model_name=name, defaults=defaults, cache_bytes=cache_bytes, session_bytes=session_bytes,
                          max_body_bytes=max_body_bytes, limits=limits,
                          data_dir=data_dir, aux=aux, tiers=tiers, host_tier_bytes=host_tier_bytes,
                          disk_tier_bytes=disk_tier_bytes, valkey_url=valkey_url, spill_tier=spill_tier,
                          api_keys=keys or None, public_prompts=public, cors_origins=tuple(cors_origin or ()),
                          allowed_hosts=hosts)
    console.log(f"serving {name} on http://{host}:{port} (policy {defaults.policy}, budget {defaults.budget}, "
                f"limit {defaults.limit}; aux {'off' if aux is None else f'every {aux.every} turns'}"
                f"{f' (rule {rule.name})' if rule is not None else ''}"
                f"{' + planner' if aux is not None and aux.plan else ''}; "
                f"{f'{len(keys)} API key(s)' if keys else 'no API keys'})")
    uvicorn.run(create_app(engine, config), **uvicorn_options(host, port, log_level, limit_concurrency,
                                                              timeout_keep_alive, max_header_bytes))


def read_public_prompts(path: Path | None) -> tuple[str, ...]:
    """The declared-public system prompts: a JSON list of non-empty strings (none without a file)."""
    import json

    if path is None:
        return ()
    prompts = json.loads(Path(path).read_text())
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError("expected a JSON list of non-empty strings")
    return tuple(prompts)


def uvicorn_options(host: str, port: int, log_level: str, limit_concurrency: int, timeout_keep_alive: int,
                    max_header_bytes: int) -> dict:
    """uvicorn.run keyword arguments: the h11 parser (it bounds the request head; httptools does not) answering an
    over-long head 414 / 431 with a lingering close (`serve/server/protocol.py`), a concurrency cap (503 beyond), a
    keep-alive timeout, no Server header."""
    from kvsteward.serve.server.protocol import LingeringH11Protocol

    return dict(host=host, port=port, log_level=log_level, http=LingeringH11Protocol,
                limit_concurrency=limit_concurrency, timeout_keep_alive=timeout_keep_alive,
                h11_max_incomplete_event_size=max_header_bytes, server_header=False, timeout_graceful_shutdown=30)


if __name__ == "__main__":
    app()
