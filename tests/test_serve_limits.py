"""Request limits that protect the server from one huge request: the default `max_prompt_tokens` (the model's
positions), refusal from the prompt's byte size alone before it is tokenized, on every path (chat, reposition,
bounded policy, session turn, session turn with reposition); work cancelled once the client has gone; an over-long
request path answered 414 (not a reset connection)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.engine.ops import SessionSpec
from kvsteward.serve.engine.session import Session
from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.completions import ServeLimits
from kvsteward.serve.server.prompt_bound import bytes_per_token, min_tokens
from kvsteward.serve.server.testing import ServerThread, tiny_chat_engine

torch.set_num_threads(1)

SMALL = [{"role": "user", "content": "Open utils.py."}]


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=3)


@pytest.fixture
def no_forward(monkeypatch):
    """Any model forward fails the request (the refusals below must come before all work)."""
    def refuse(self, *a, **kw):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(Session, "_forward", refuse)


@pytest.fixture
def encoded(engine, monkeypatch):
    """Lengths of every text the tokenizer encodes."""
    sizes: list[int] = []
    tok = engine.tokenizer
    inner = tok.encode

    def counted(text, *a, **kw):
        sizes.append(len(text))
        return inner(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", counted)
    return sizes


def huge_message(engine) -> list[dict]:
    """One user message whose bytes alone prove it over the model's positions (as the issue's 655,000 words)."""
    positions = engine.model.config.max_position_embeddings
    n = int(positions * bytes_per_token(engine.tokenizer)) + 1000
    return [{"role": "user", "content": ("word " * (n // 5 + 1))[:n]}]


def refused_by_size(r) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
    assert "at least" in err["message"], err  # the byte bound refused it, not a count of its tokens


def test_max_prompt_tokens_defaults_to_the_models_positions(engine, tmp_path):
    app = create_app(engine, ServerConfig(data_dir=tmp_path))
    positions = engine.model.config.max_position_embeddings
    assert app.state.config.limits.max_prompt_tokens == positions
    assert app.state.chat.limits.max_prompt_tokens == positions == app.state.store.limits.max_prompt_tokens
    given = create_app(engine, ServerConfig(data_dir=tmp_path / "given", limits=ServeLimits(max_prompt_tokens=64)))
    assert given.state.config.limits.max_prompt_tokens == 64


@pytest.mark.parametrize("extra", [
    {},
    {"cache": {"reposition": [0]}},  # positions given back: no context check would stop it
    {"policy": "h2o", "budget": 256, "limit": 2048},  # bounded: no context check would stop it either
    {"stream": True, "policy": "h2o", "budget": 256, "limit": 2048},
])
def test_a_huge_chat_is_refused_by_its_size_before_tokenizing(engine, tmp_path, no_forward, encoded, extra):
    client = TestClient(create_app(engine, ServerConfig(data_dir=tmp_path)))
    t0 = time.monotonic()
    refused_by_size(client.post("/v1/chat/completions", json={"messages": huge_message(engine), **extra}))
    assert max(encoded, default=0) < 10_000  # the huge text itself was never tokenized
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("cache", [None, {"reposition": [0]}])
def test_a_huge_session_turn_is_refused_by_its_size_before_tokenizing(engine, tmp_path, no_forward, encoded, cache):
    client = TestClient(create_app(engine, ServerConfig(data_dir=tmp_path)))
    sid = client.post("/v1/sessions", json={"policy": "h2o", "budget": 256, "limit": 2048}).json()["id"]
    body = {"messages": huge_message(engine), "max_tokens": 2, **({"cache": cache} if cache else {})}
    refused_by_size(client.post(f"/v1/sessions/{sid}/messages", json=body))
    assert max(encoded, default=0) < 10_000
    assert client.get(f"/v1/sessions/{sid}").json()["n_messages"] == 0  # nothing was appended


def test_the_byte_bound_never_exceeds_the_token_count(engine):
    """tokens >= ceil(bytes / bytes_per_token) on texts built to pack the most bytes into each token."""
    tok = engine.tokenizer
    per = bytes_per_token(tok)
    assert per is not None and per >= max(len(s) for s in tok.get_vocab())
    vocab = tok.get_vocab()
    longest = tok.convert_tokens_to_string([max(vocab, key=len)])
    texts = [longest * 50, " " * 5000, "\n" + " " * 4999, "=" * 5000, "-" * 3000 + "\n", "é" * 2000, "🙂" * 1000,
             "<|im_start|>" * 300, "a" * 5000, "".join(chr(0x4E00 + i) for i in range(2000))]
    for text in texts:
        n = len(tok.encode(text, add_special_tokens=False))
        assert n >= min_tokens(text, per), (text[:20], n)


def test_tokenizers_that_swallow_input_give_no_byte_bound():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(tk: Tokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=tk)

    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    assert bytes_per_token(fast(words)) is None  # whitespace is removed; [UNK] stands for any word
    bpe = Tokenizer(models.BPE({"a": 0, "ab": 1, "b": 2}, [("a", "b")], unk_token=None, byte_fallback=True))
    assert bytes_per_token(fast(bpe)) == 2.0
    bpe.normalizer = normalizers.NFKC()
    assert bytes_per_token(fast(bpe)) == 16.0  # a normalizer may shrink the input 8x
    bpe.normalizer = normalizers.Strip()
    assert bytes_per_token(fast(bpe)) is None


# -- work stops when the client goes ---------------------------------------------------------------------------------
@pytest.fixture
def slow_forwards(monkeypatch):
    """Counts forwards; each takes at least 30 ms (a long prefill on a tiny model)."""
    count = {"n": 0}
    inner = Session._forward

    def slow(self, *a, **kw):
        count["n"] += 1
        time.sleep(0.03)
        return inner(self, *a, **kw)

    monkeypatch.setattr(Session, "_forward", slow)
    return count


def hang_up(port: int, path: str, body: dict, wait: float = 0.5) -> None:
    """POST `body` and close the connection after `wait` seconds, before any answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=wait)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        with pytest.raises((TimeoutError, socket.timeout)):
            conn.getresponse()
    finally:
        conn.close()


def settles(count: dict, quiet: float = 0.6, within: float = 5.0) -> int:
    """The forward count once it has stopped growing for `quiet` seconds."""
    deadline = time.monotonic() + within
    last = count["n"]
    while time.monotonic() < deadline:
        time.sleep(quiet)
        if count["n"] == last:
            return last
        last = count["n"]
    raise AssertionError(f"forwards still running after {within} s: {count['n']}")


LONG = [{"role": "user", "content": "lorem ipsum dolor sit amet " * 150}]  # ~1,000 tokens: ~125 chunks of 8


@pytest.mark.parametrize("path", ["chat", "stream", "turn"])
def test_work_stops_when_the_client_disconnects(engine, tmp_path, slow_forwards, path):
    app = create_app(engine, ServerConfig(data_dir=tmp_path, defaults=SessionSpec(chunk=8)))
    with ServerThread(app) as url:
        port = int(url.rsplit(":", 1)[1])
        if path == "turn":
            sid = TestClient(app).post("/v1/sessions", json={}).json()["id"]
            url_path, body = f"/v1/sessions/{sid}/messages", {"messages": LONG, "max_tokens": 200}
        else:
            url_path, body = "/v1/chat/completions", {"messages": LONG, "max_tokens": 200, "stream": path == "stream"}
        hang_up(port, url_path, body)
        done = settles(slow_forwards)
        assert 0 < done < 60, done  # a full run is > 125 prefill chunks + 200 decode steps
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # the server serves the next request
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": SMALL, "max_tokens": 1}),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
    if path == "turn":  # the cancelled turn persisted nothing
        assert TestClient(app).get(f"/v1/sessions/{sid}").json()["n_messages"] == 0


def test_a_stream_stops_decoding_when_its_client_leaves(engine, tmp_path, slow_forwards):
    """Hung up after the first chunk: the decode stops at its next token, and the main work ends (the aux thread
    may run again)."""
    app = create_app(engine, ServerConfig(data_dir=tmp_path))
    with ServerThread(app) as url:
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": SMALL, "max_tokens": 300,
                                                                      "stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.read1(100).startswith(b"data: ")
        conn.close()
        done = settles(slow_forwards)
        assert done < 100, done  # a full run is 300 decode steps
        assert app.state.scheduler._main == 0


def test_a_cancellable_append_builds_the_same_state(engine):
    """`run_op` appends a long message chunk by chunk: the same state and history as one append."""
    from kvsteward.serve.server.completions import run_op

    tokens = engine.tokenizer.encode("lorem ipsum dolor sit amet " * 20)
    whole, pieces = engine.session("h2o", budget=24, chunk=8), engine.session("h2o", budget=24, chunk=8)
    lock = threading.Lock()
    whole.append(tokens, kind="user", logits=None)
    run_op(pieces, ("append", "user", tuple(tokens)), [], lock, threading.Event())
    assert pieces.history == whole.history and pieces.history_key() == whole.history_key()
    assert torch.equal(pieces.last_logits, whole.last_logits)
    assert pieces.resident_logical().tolist() == whole.resident_logical().tolist()


# -- the request line ------------------------------------------------------------------------------------------------
def raw_exchange(port: int, head: bytes) -> bytes:
    """Send a whole request head and read the answer to its end (a reset raises ConnectionResetError)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def test_an_over_long_path_gets_414_and_a_huge_header_431(engine, tmp_path):
    from kvsteward.pipelines.cli_serve import uvicorn_options

    options = uvicorn_options("127.0.0.1", 0, "warning", limit_concurrency=8, timeout_keep_alive=2,
                              max_header_bytes=16384)
    options = {k: v for k, v in options.items() if k not in ("host", "port")}
    server = ServerThread(create_app(engine, ServerConfig(data_dir=tmp_path)), **options)
    with server:
        reply = raw_exchange(server.port, b"GET /" + b"a" * 200_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"414", reply[:200]
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        reply = raw_exchange(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000
                             + b"\r\n\r\n")
        assert reply.split(b" ")[1] == b"431", reply[:200]
        reply = raw_exchange(server.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert reply.split(b" ")[1] == b"200"
