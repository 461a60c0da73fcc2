"""`steward serve` hardened: client input never gives a 500 (every 4xx names its field), 500s are counted, limits are
checked before any forward, API keys + session ownership, CORS / Host / content-type rules, the CLI's refusals and
uvicorn limits, and request schemas in /openapi.json."""

from __future__ import annotations

import json

import pytest
import torch
from starlette.testclient import TestClient
from typer.testing import CliRunner

from kvsteward.serve.engine.session import Session
from kvsteward.serve.server.api import ServerConfig, create_app, parse_api_keys, public_model_id
from kvsteward.serve.server.completions import ServeLimits
from kvsteward.serve.server.testing import TEST_HOSTS, ServerThread, bearer, tiny_chat_engine

torch.set_num_threads(1)

MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "Open utils.py."},
    {"role": "tool", "content": "def parse(s):\n    return s.split(',')\n"},
    {"role": "user", "content": "What does parse do?"},
]


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=2)


def make_app(engine, tmp_path, **kw):
    return create_app(engine, ServerConfig(data_dir=tmp_path, **kw))


@pytest.fixture
def client(engine, tmp_path):
    return TestClient(make_app(engine, tmp_path))


@pytest.fixture
def forwards(monkeypatch):
    """Counts model forwards (every prefill chunk and decode step goes through Session._forward)."""
    count = {"n": 0}
    inner = Session._forward

    def counted(self, *a, **kw):
        count["n"] += 1
        return inner(self, *a, **kw)

    monkeypatch.setattr(Session, "_forward", counted)
    return count


def post(client, body: dict, path: str = "/v1/chat/completions", **kw):
    return client.post(path, json={"messages": MESSAGES, "max_tokens": 3, **body} if path.endswith("completions")
                       else body, **kw)


def refused(r, status: int, param_prefix: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param_prefix is not None:
        assert err["param"] is not None and err["param"].startswith(param_prefix), err
    if code is not None:
        assert err["code"] == code, err
    return err


# -- 1. client input never gives a 500 -------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", [
    {"drop": {"²": [0]}},  # str.isdigit() is True, int() raises
    {"drop": {"١": [0]}},  # Arabic-Indic one: int() would read it as 1
    {"drop": {"2": ["١"]}},
    {"reposition": ["²"]},
    {"drop": {"9" * 40: [0]}},
])
def test_cache_indices_take_ascii_digits_only(client, cache):
    refused(post(client, {"cache": cache}), 400, "cache")
    assert post(client, {"cache": {"drop": {"3": [2]}}}).status_code == 200  # ASCII digit strings still work


def test_bad_stream_options_are_refused_before_main_work_begins(engine, tmp_path):
    app = make_app(engine, tmp_path)
    client = TestClient(app)
    for options in ["yes", [1], 3]:
        refused(post(client, {"stream": True, "stream_options": options}), 400, "stream_options")
        assert app.state.scheduler.main_active == 0  # the aux thread is not starved by a refused request
    refused(post(client, {"stream": True, "stream_options": {"include_usage": "y"}}), 400, "stream_options")
    refused(post(client, {"stream": True, "cache": {"reposition": [99]}}), 400, "cache")
    assert app.state.scheduler.main_active == 0
    refused(post(client, {"stream": "yes"}), 400, "stream")
    r = post(client, {"stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage"' in r.text
    assert app.state.scheduler.main_active == 0


def test_blueprint_ints_beyond_int64_are_refused_at_parse_time(client):
    huge = {"policy": "foresight", "budget": 48}
    for bp in ([{"span": [0, 2**63 + 5], "readers": [3]}], [{"span": [0, 4], "readers": [2**64]}]):
        refused(client.post("/v1/sessions", json={**huge, "blueprint": bp}), 400, "blueprint")
        refused(post(client, {**huge, "blueprint": bp}), 400, "blueprint")
    r = client.post("/v1/sessions", json={**huge, "blueprint": [{"span": [0, 2**62], "readers": [2**62]}]})
    assert r.status_code == 200, r.text  # the bound itself is usable: turns of this session work
    t = client.post(f"/v1/sessions/{r.json()['id']}/messages", json={"messages": MESSAGES[:2], "max_tokens": 2})
    assert t.status_code == 200, t.text


def test_hostile_json_gets_a_400(client):
    raw = {
        "deep": b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        "nested": json.dumps({"messages": MESSAGES, "tools": [json.loads("[" * 100 + "]" * 100)]}).encode(),
        "bigint": b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}",
        "surrogate": b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
        "surrogate_key": b'{"messages": [{"role": "user", "content": "hi", "\\udfff": 1}]}',
    }
    for name, payload in raw.items():
        r = client.post("/v1/chat/completions", content=payload, headers={"content-type": "application/json"})
        err = refused(r, 400, None)
        if name.startswith("surrogate"):
            assert err["param"].startswith("messages[0]"), err
        for path in ("/v1/sessions",):
            assert client.post(path, content=payload, headers={"content-type": "application/json"}).status_code == 400
    assert post(client, {}).status_code == 200


def test_model_field_names_the_served_model(client):
    assert post(client, {"model": "kvsteward"}).status_code == 200
    assert post(client, {}).json()["model"] == "kvsteward"
    refused(post(client, {"model": "gpt-4o"}), 404, "model", "model_not_found")
    refused(post(client, {"model": 5}), 400, "model")
    refused(client.post("/v1/sessions", json={"model": "other"}), 404, "model", "model_not_found")


def test_public_model_id_is_never_a_path(tmp_path):
    folder = tmp_path / "checkpoints" / "my-model"
    folder.mkdir(parents=True)
    assert public_model_id(str(folder)) == "my-model"
    assert public_model_id("smollm2") == "smollm2"
    assert public_model_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_405_carries_allow(client):
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = client.put("/v1/sessions/sess_0", json={})
    assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "DELETE"}


# -- 2. 500s are counted -----------------------------------------------------------------------------------------------
def _metric(client, name: str, headers=None) -> float:
    for line in client.get("/metrics", headers=headers).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


def test_internal_errors_are_counted_and_reveal_no_details(engine, tmp_path, monkeypatch):
    app = make_app(engine, tmp_path)
    client = TestClient(app, raise_server_exceptions=False)

    def boom(*a, **kw):
        raise RuntimeError("secret internal state /etc/passwd")

    monkeypatch.setattr(app.state.chat, "complete", boom)
    r = post(client, {})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text
    assert _metric(client, 'kvsteward_requests_total{endpoint="/v1/chat/completions",status="500"}') == 1
    monkeypatch.undo()
    assert post(client, {}).status_code == 200  # still serving


# -- 3. limits before work -------------------------------------------------------------------------------------------
def test_over_limit_prompts_are_refused_before_any_forward(engine, tmp_path, forwards):
    app = make_app(engine, tmp_path, limits=ServeLimits(max_messages=3, max_prompt_tokens=40))
    client = TestClient(app)
    cache = app.state.chat.cache
    refused(post(client, {}), 400, "messages", "too_many_messages")  # 4 messages > 3
    long = [{"role": "user", "content": "word " * 60}]
    refused(post(client, {"messages": long}), 400, "messages", "context_length_exceeded")
    refused(post(client, {"messages": long, "stream": True}), 400, "messages", "context_length_exceeded")
    assert forwards["n"] == 0 and cache.states == 0 and cache.bytes == 0
    sid = client.post("/v1/sessions", json={}).json()["id"]
    refused(client.post(f"/v1/sessions/{sid}/messages", json={"messages": MESSAGES}), 400, "messages")
    refused(client.post(f"/v1/sessions/{sid}/messages", json={"messages": long}), 400, "messages")
    assert forwards["n"] == 0
    assert post(client, {"messages": MESSAGES[:2]}).status_code == 200 and forwards["n"] > 0


def test_the_models_context_is_checked_before_any_forward(engine, tmp_path, forwards):
    app = make_app(engine, tmp_path)
    client = TestClient(app)  # the tiny model has 4096 positions; max_tokens may be up to 4096
    refused(post(client, {"max_tokens": 4096}), 400, "messages", "context_length_exceeded")
    assert forwards["n"] == 0 and app.state.chat.cache.states == 0
    # bounded positions renumber instead: not refused (the time budget keeps the decode to one token)
    client = TestClient(make_app(engine, tmp_path / "bounded", limits=ServeLimits(request_timeout=1e-6)))
    r = post(client, {"max_tokens": 4096, "policy": "streaming", "budget": 32, "limit": 600})
    assert r.status_code == 200, r.text


def test_request_timeout_ends_the_decode_with_length(engine, tmp_path):
    client = TestClient(make_app(engine, tmp_path, limits=ServeLimits(request_timeout=1e-6)))
    r = post(client, {"max_tokens": 20})
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 1
    r = post(client, {"max_tokens": 20, "stream": True})
    finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in r.text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert finish[-1] == "length"
    with pytest.raises(ValueError, match="request_timeout"):
        make_app(engine, tmp_path / "bad", limits=ServeLimits(request_timeout=0))


# -- 4. access control -----------------------------------------------------------------------------------------------
KEYS = {"k-alice-123": "alice", "k-bob-456": "bob"}


def test_api_keys_guard_everything_but_health(engine, tmp_path):
    client = TestClient(make_app(engine, tmp_path, api_keys=KEYS))
    assert client.get("/health").status_code == 200
    for method, path in [("get", "/v1/models"), ("get", "/metrics"), ("get", "/v1/sessions"),
                         ("get", "/openapi.json"), ("post", "/v1/chat/completions")]:
        r = getattr(client, method)(path)
        refused(r, 401, None, "invalid_api_key")
        assert r.headers["www-authenticate"].startswith("Bearer")
        r = getattr(client, method)(path, headers=bearer("k-wrong"))
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert getattr(client, method)(path, headers={"Authorization": "Basic k-alice-123"}).status_code == 401
    assert client.get("/v1/models", headers=bearer("k-alice-123")).status_code == 200
    assert client.get("/metrics", headers=bearer("k-bob-456")).status_code == 200
    assert post(client, {}, headers=bearer("k-alice-123")).status_code == 200


def test_sessions_belong_to_the_key_that_created_them(engine, tmp_path):
    app = make_app(engine, tmp_path, api_keys={**KEYS, "bare-key-789": "key-" + "0" * 16})
    client = TestClient(app)
    alice, bob = bearer("k-alice-123"), bearer("k-bob-456")
    sid = client.post("/v1/sessions", json={}, headers=alice).json()["id"]
    assert [s["id"] for s in client.get("/v1/sessions", headers=alice).json()["data"]] == [sid]
    assert client.get("/v1/sessions", headers=bob).json()["data"] == []
    refused(client.get(f"/v1/sessions/{sid}", headers=bob), 404, "session_id")
    refused(client.post(f"/v1/sessions/{sid}/messages", json={"messages": MESSAGES[:2]}, headers=bob), 404,
            "session_id")
    refused(client.delete(f"/v1/sessions/{sid}", headers=bob), 404, "session_id")
    assert client.get(f"/v1/sessions/{sid}", headers=alice).status_code == 200
    log = (tmp_path / "sessions" / f"{sid}.jsonl").read_text()
    assert json.loads(log.splitlines()[0])["owner"] == "alice" and "k-alice-123" not in log  # never the key
    assert client.delete(f"/v1/sessions/{sid}", headers=alice).status_code == 200


def test_idempotency_key_header_is_validated_and_wired(engine, tmp_path):
    client = TestClient(make_app(engine, tmp_path))
    sid = client.post("/v1/sessions", json={}).json()["id"]
    url = f"/v1/sessions/{sid}/messages"
    for bad in ["x" * 256, " leading", "tab\tin"]:
        refused(client.post(url, json={"messages": MESSAGES[:2]}, headers={"Idempotency-Key": bad}), 400,
                "Idempotency-Key")
    assert client.get(f"/v1/sessions/{sid}").json().get("turns", 0) in (0, None)
    body = {"messages": MESSAGES[:2], "max_tokens": 3}
    first = client.post(url, json=body, headers={"Idempotency-Key": "turn-1"})
    assert first.status_code == 200, first.text
    again = client.post(url, json=body, headers={"Idempotency-Key": "turn-1"})
    assert again.status_code == 200 and again.json()["turn"] == first.json()["turn"] == 0
    other = client.post(url, json={**body, "max_tokens": 4}, headers={"Idempotency-Key": "turn-1"})
    refused(other, 422, "Idempotency-Key")


def test_parse_api_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nalice:sk-a1\n\n  sk-bare  # a bare key\nbob: sk-b2\n")
    keys = parse_api_keys(["sk-cli"], [f])
    assert keys["sk-a1"] == "alice" and keys["sk-b2"] == "bob"
    assert keys["sk-bare"].startswith("key-") and "sk-bare" not in keys["sk-bare"]
    assert keys["sk-cli"] != keys["sk-bare"]
    f.write_text("alice:sk-a1\ncarol:sk-a1\n")
    with pytest.raises(ValueError, match="already listed"):
        parse_api_keys((), [f])


def test_cors_is_off_unless_origins_are_given(engine, tmp_path):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    off = TestClient(make_app(engine, tmp_path / "off"))
    r = off.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in off.get("/v1/models", headers={"Origin": "https://app.example"}).headers
    on = TestClient(make_app(engine, tmp_path / "on", cors_origins=("https://app.example",), api_keys=KEYS))
    r = on.options("/v1/chat/completions", headers=preflight)  # answered without a key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = on.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_text_plain_bodies_are_refused_with_415(client, forwards):
    for ctype in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]:
        headers = {} if ctype is None else {"content-type": ctype}
        payload = json.dumps({"messages": MESSAGES, "max_tokens": 2})
        for path in ("/v1/chat/completions", "/v1/sessions"):
            refused(client.post(path, content=payload, headers=headers), 415, "Content-Type")
    assert forwards["n"] == 0
    r = client.post("/v1/chat/completions", content=json.dumps({"messages": MESSAGES, "max_tokens": 2}),
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_host_allowlist(engine, tmp_path):
    client = TestClient(make_app(engine, tmp_path, allowed_hosts=TEST_HOSTS))
    assert client.get("/health").status_code == 200
    assert client.get("/health", headers={"Host": "localhost:8000"}).status_code == 200
    assert client.get("/health", headers={"Host": "[::1]:8000"}).status_code == 200
    refused(client.get("/health", headers={"Host": "attacker.example"}), 400, "Host")  # DNS rebinding
    open_ = TestClient(make_app(engine, tmp_path / "any"))  # no allowlist: any Host
    assert open_.get("/health", headers={"Host": "attacker.example"}).status_code == 200


def test_cli_refuses_an_open_bind_without_keys(tmp_path):
    from kvsteward.pipelines import cli_serve

    def refusal(args: list[str]) -> str:
        r = CliRunner().invoke(cli_serve.app, args)
        assert r.exit_code != 0
        return " ".join(r.output.replace("│", " ").split())

    assert "no API key is configured" in refusal(["--host", "0.0.0.0"])
    assert "--insecure-no-auth" in refusal(["--host", "::"])
    (tmp_path / "keys").write_text("alice:\n")
    assert "printable ASCII" in refusal(["--host", "0.0.0.0", "--api-keys-file", str(tmp_path / "keys")])
    assert "request_timeout" in refusal(["--request-timeout", "0"])
    r = CliRunner().invoke(cli_serve.app, ["--help"])
    for option in ["--api-key", "--api-keys-file", "--insecure-no-auth", "--cors-origin", "--allowed-host",
                   "--max-messages", "--max-prompt-tokens", "--request-timeout", "--limit-concurrency",
                   "--timeout-keep-alive", "--max-header-bytes", "--served-model-name"]:
        assert option in r.output


def test_uvicorn_limits_apply_to_a_live_server(engine, tmp_path):
    import http.client

    from kvsteward.pipelines.cli_serve import uvicorn_options

    options = uvicorn_options("127.0.0.1", 0, "warning", limit_concurrency=8, timeout_keep_alive=2,
                              max_header_bytes=4096)
    options = {k: v for k, v in options.items() if k not in ("host", "port")}
    server = ServerThread(make_app(engine, tmp_path), **options)

    def status(headers: dict) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            conn.request("GET", "/health", headers=headers)
            return conn.getresponse().status
        finally:
            conn.close()

    def unfinished_head(n: int) -> bytes:  # a request head that never ends, n bytes long
        import socket

        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * n)
            try:
                return sock.recv(200)
            except TimeoutError:
                return b""

    with server:
        assert server.server.config.limit_concurrency == 8 and server.server.config.timeout_keep_alive == 2
        assert status({}) == 200
        reply = unfinished_head(8000)  # refused by the h11 parser before the app: the head may not grow further
        assert reply.split(b" ")[1] == b"431", reply  # headers too large (a long request line gets 414)
        assert status({}) == 200


# -- 5. request schemas ----------------------------------------------------------------------------------------------
def test_openapi_describes_the_request_bodies(client):
    schema = client.get("/openapi.json").json()
    comps = schema["components"]["schemas"]
    chat = comps["ChatCompletionRequest"]["properties"]
    for name in ["model", "messages", "max_tokens", "stream", "stream_options", "stop", "cache", "policy", "budget",
                 "limit", "blueprint", "tools"]:
        assert name in chat, name
    assert {"policy", "budget", "limit", "blueprint", "tools"} <= set(comps["SessionCreateRequest"]["properties"])
    assert {"messages", "cache", "generate", "max_tokens", "stop"} <= set(comps["SessionTurnRequest"]["properties"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"] == "#/components/schemas/ChatCompletionRequest"
    turn = schema["paths"]["/v1/sessions/{session_id}/messages"]["post"]["requestBody"]
    assert turn["content"]["application/json"]["schema"]["$ref"].endswith("/SessionTurnRequest")
    # hand validation and the error shape are unchanged
    refused(post(client, {"messages": "hi"}), 400, "messages")


def test_session_turns_get_the_time_budget_and_the_context_check_before_forwards(engine, tmp_path, forwards):
    """A session turn's reply stops at the time budget (its tokens all kept: the next turn continues the session),
    and a turn that cannot fit the model's positions is refused before any forward, leaving the session as it was."""
    client = TestClient(make_app(engine, tmp_path, limits=ServeLimits(request_timeout=1e-6)))
    sid = client.post("/v1/sessions", json={}).json()["id"]
    r = client.post(f"/v1/sessions/{sid}/messages", json={"messages": MESSAGES, "max_tokens": 20})
    assert r.status_code == 200, r.text
    reply = r.json()["reply"]
    assert reply["finish_reason"] == "length" and reply["completion_tokens"] == 1
    before = client.get(f"/v1/sessions/{sid}").json()
    forwards["n"] = 0
    r = client.post(f"/v1/sessions/{sid}/messages", json={"messages": [{"role": "user", "content": "more"}],
                                                           "max_tokens": 4096})
    refused(r, 400, "messages", "context_length_exceeded")
    assert forwards["n"] == 0
    assert client.get(f"/v1/sessions/{sid}").json() == before
    r = client.post(f"/v1/sessions/{sid}/messages", json={"messages": [{"role": "user", "content": "more"}],
                                                           "max_tokens": 2})
    assert r.status_code == 200, r.text  # the refused turn left nothing behind


def test_a_repositioned_prompt_without_room_is_refused_before_it_is_cached(engine, tmp_path):
    """With a `reposition` the positions it gives back are known only once it ran: the state is built, found
    without room for the reply, and refused before it enters the prefix cache."""
    app = make_app(engine, tmp_path)
    client = TestClient(app)
    cache = {"drop": {"2": [1]}, "reposition": [2]}
    refused(post(client, {"max_tokens": 4096, "cache": cache}), 400, "messages", "context_length_exceeded")
    assert app.state.chat.cache.states <= 1  # at most the checkpoint before the last message (a valid prefix)
    r = post(client, {"max_tokens": 2, "cache": cache})
    assert r.status_code == 200
    first = r.json()["kvsteward"]["reused_tokens"]  # from the checkpoint: the refused state was not cached
    again = post(client, {"max_tokens": 2, "cache": cache}).json()["kvsteward"]["reused_tokens"]
    assert first < again  # the accepted state was: the whole prompt is reused now
