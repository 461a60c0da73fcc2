"""A bounded concurrent load test against a live server on 127.0.0.1: 8 client threads × 5 requests (stateless
completions with mixed cache ops / policies / streaming, and turns of per-thread persistent sessions), three rounds.
No errors, no cross-request leakage (every output equals the same request run alone on a fresh server), memory flat
once warm while the prefix cache evicts under a small byte budget: after every round the only engine states alive
in the process are the ones the prefix cache holds (exact accounting), and RSS growth after warm-up is bounded."""

from __future__ import annotations

import ctypes
import gc
import random
import threading
import time

import openai
import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.engine.session import Session
from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.testing import ServerThread, tiny_chat_engine

torch.set_num_threads(1)

THREADS, PER_THREAD, ROUNDS = 8, 5, 3
CACHE_BYTES = 120_000  # ~4 tiny-model prompt states: forces LRU evictions under load
BASE = [
    {"role": "system", "content": "You are a coding agent with tools."},
    {"role": "user", "content": "Find the bug in app.py."},
    {"role": "assistant", "content": "read_file('app.py')"},
    {"role": "tool", "content": "import os\nprint(os.getcwd())\n" * 4},
    {"role": "assistant", "content": "The file prints the working directory."},
    {"role": "user", "content": "Run the tests."},
    {"role": "assistant", "content": "run('pytest -q')"},
    {"role": "tool", "content": "3 passed, 1 failed: test_parse\n" * 3},
]


def rss_mb() -> float:
    """Resident set size after handing freed heap pages back (glibc keeps freed memory in per-thread arenas, which
    would otherwise read as growth without anything being alive)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def live_sessions(engine) -> int:
    """Engine states of `engine` alive anywhere in the process (other tests' apps use other engines)."""
    gc.collect()
    objs = gc.get_objects()
    n = sum(1 for o in objs if type(o) is Session and o.engine is engine)  # type(): no attribute probing
    del objs
    return n


def stateless_request(t: int, k: int) -> dict:
    rng = random.Random(1000 * t + k)
    n = rng.randint(4, len(BASE))
    messages = BASE[:n] + [{"role": "user", "content": f"Thread {t % 4} asks question {k % 2}."}]
    body: dict = {"messages": messages, "max_tokens": rng.randint(3, 6), "stream": rng.random() < 0.4}
    if rng.random() < 0.6:  # an AKV rolling drop of a tool output, sometimes with a reposition
        i = rng.randint(3, n - 1)
        body["cache"] = {"drop": {str(i): [3]}, **({"reposition": [i]} if rng.random() < 0.5 else {})}
    if rng.random() < 0.3:
        body.update(policy=rng.choice(["h2o", "streaming", "snapkv"]), budget=48)
    return body


def session_turns(t: int) -> list[dict]:
    return [{"messages": BASE[:4], "max_tokens": 3},
            {"messages": [{"role": "user", "content": f"thread {t}"}], "cache": {"drop": {"4": [3]}},
             "max_tokens": 3}]


def plan(t: int) -> list[tuple[str, object]]:
    """Request k of thread t: stateless at k = 0, 2, 4; the thread's own session turns at k = 1, 3."""
    turns = iter(session_turns(t))
    return [("chat", stateless_request(t, k)) if k % 2 == 0 else ("turn", next(turns)) for k in range(PER_THREAD)]


def chat_result(client: openai.OpenAI, body: dict) -> tuple[str, str]:
    extra = {k: v for k, v in body.items() if k not in ("messages", "max_tokens", "stream")}
    args = dict(model="kvsteward", messages=body["messages"], max_tokens=body["max_tokens"], extra_body=extra)
    if body["stream"]:
        chunks = list(client.chat.completions.create(stream=True, **args))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].model_extra["kvsteward"]["history_key"]
    r = client.chat.completions.create(**args)
    return r.choices[0].message.content, r.model_extra["kvsteward"]["history_key"]


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=3)


def expected_results(engine, tmp_path) -> dict:
    """Every request alone: stateless ones on a server that caches nothing, each thread's session on a fresh one."""
    want = {}
    alone = TestClient(create_app(engine, ServerConfig(data_dir=tmp_path / "alone", cache_bytes=0)))
    for t in range(THREADS):
        sid = alone.post("/v1/sessions", json={}).json()["id"]
        for k, (kind, body) in enumerate(plan(t)):
            if kind == "chat":
                r = alone.post("/v1/chat/completions", json={**body, "stream": False}).json()
                want[t, k] = (r["choices"][0]["message"]["content"], r["kvsteward"]["history_key"])
            else:
                r = alone.post(f"/v1/sessions/{sid}/messages", json=body).json()
                want[t, k] = (r["reply"]["content"], r["history_key"])
        alone.delete(f"/v1/sessions/{sid}")
    return want


def test_concurrent_mixed_load_no_errors_no_leakage_flat_memory(engine, tmp_path):
    want = expected_results(engine, tmp_path)
    app = create_app(engine, ServerConfig(data_dir=tmp_path / "live", cache_bytes=CACHE_BYTES))
    errors: list[str] = []
    mismatches: list[tuple] = []
    rss, seconds = [], []
    with ServerThread(app) as url:
        clients = [openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
                   for _ in range(THREADS)]

        def worker(t: int, round_: int) -> None:
            client = clients[t]
            http = client._client  # the same pool for the session endpoints
            sid = http.post(url + "/v1/sessions", json={}).json()["id"]
            for k, (kind, body) in enumerate(plan(t)):
                try:
                    if kind == "chat":
                        got = chat_result(client, body)
                    else:
                        r = http.post(f"{url}/v1/sessions/{sid}/messages", json=body, timeout=120)
                        r.raise_for_status()
                        got = (r.json()["reply"]["content"], r.json()["history_key"])
                except Exception as e:  # noqa: BLE001 - every failure is collected and reported
                    errors.append(f"round {round_} thread {t} request {k}: {type(e).__name__}: {e}")
                    continue
                if got != want[t, k]:
                    mismatches.append((round_, t, k, got, want[t, k]))
            if http.delete(f"{url}/v1/sessions/{sid}").status_code != 200:
                errors.append(f"round {round_} thread {t}: delete failed")

        for round_ in range(ROUNDS):
            t0 = time.perf_counter()
            threads = [threading.Thread(target=worker, args=(t, round_)) for t in range(THREADS)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=300)
            assert not any(th.is_alive() for th in threads), "load round did not finish in time"
            seconds.append(time.perf_counter() - t0)
            rss.append(rss_mb())
        alive, held = live_sessions(engine), app.state.chat.cache.states  # scanned once: a scan itself costs RSS
    assert not errors, errors[:5]
    assert not mismatches, mismatches[:3]
    chat_cache = app.state.chat.cache
    assert chat_cache.evictions > 0 and chat_cache.bytes <= CACHE_BYTES
    growth = rss[-1] - rss[0]
    print(f"\nload: {THREADS} threads x {PER_THREAD} requests x {ROUNDS} rounds; seconds per round "
          f"{[round(s, 2) for s in seconds]}; RSS MB after each round {[round(r, 1) for r in rss]} "
          f"(growth after warm-up {growth:.1f} MB); engine states alive at the end {alive} = cached {held}; "
          f"prefix-cache evictions {chat_cache.evictions}, bytes {chat_cache.bytes}; "
          f"trie nodes {chat_cache.node_count()}")
    assert alive == held  # no request, stream or deleted session leaves an engine state behind
    assert app.state.metrics.sessions_active._value.get() == 0
    assert growth < 32, f"RSS grew {growth:.1f} MB between round 1 and round {ROUNDS}"
