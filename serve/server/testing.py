"""Test helpers for the HTTP layer: a tiny random model behind the real SmolLM2 tokenizer (chat template included),
and a uvicorn server running in a thread on 127.0.0.1 and a free port."""

from __future__ import annotations

import socket
import threading
import time

from kvsteward.serve.engine import Engine

TEST_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]", "testserver")  # the loopback allowlist + starlette's TestClient


def bearer(key: str) -> dict:
    """Request headers carrying API key `key`."""
    return {"Authorization": f"Bearer {key}"}


def tiny_chat_engine(seed: int = 0) -> Engine:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer (loads in seconds, no weights)."""
    from kvsteward.models import load_tokenizer, tiny_model

    tok = load_tokenizer("smollm2")
    return Engine(tiny_model("llama", seed=seed, vocab=len(tok)), tok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(app) as url:` serves `app` until the block ends; `options`: more uvicorn.Config arguments
    (e.g. `steward serve`'s limits from `cli_serve.uvicorn_options`)."""

    def __init__(self, app, port: int | None = None, **options):
        import uvicorn

        self.port = port or free_port()
        options = {"log_level": "warning", **options, "host": "127.0.0.1", "port": self.port}
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def turn(client, sid: str, body: dict) -> dict:
    """POST one persistent-session turn through a TestClient; asserts success and returns the JSON reply."""
    r = client.post(f"/v1/sessions/{sid}/messages", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def live(app, sid: str):
    """The store's loaded record of session `sid` (loaded on demand, released right away)."""
    store = app.state.store
    rec = store.acquire(sid)
    store.release(rec)
    return rec
