"""Persistent sessions: turns with cache ops, fsynced logs, exact rebuild after a restart (bitwise-equal next-token
logits), torn-line recovery, rollback of a refused turn, LRU unloading, and a real `kill -9` of a server process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx2
import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.server.api import ServerConfig, create_app
from kvsteward.serve.server.testing import free_port, tiny_chat_engine

torch.set_num_threads(1)

TURNS = [
    {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List files."}],
     "max_tokens": 5},
    {"messages": [{"role": "tool", "content": "a.py b.py c.py " * 10}], "max_tokens": 4},
    {"messages": [{"role": "user", "content": "Open a.py"}], "cache": {"drop": {"4": [3]}, "reposition": [4]},
     "max_tokens": 6, "stop": ["zzz"]},
    {"messages": [{"role": "tool", "content": "print('hi')"}, {"role": "user", "content": "Run it."}]},
]


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=2)


def app(engine, path, **kw):
    return create_app(engine, ServerConfig(data_dir=path, **kw))


def run_turns(client, sid, turns):
    out = []
    for t in turns:
        r = client.post(f"/v1/sessions/{sid}/messages", json=t)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def live_session(test_app, sid):
    rec = test_app.state.store.acquire(sid)
    test_app.state.store.release(rec)
    return rec


def test_turns_persist_and_rebuild_exactly_after_restart(engine, tmp_path):
    a = app(engine, tmp_path)
    ca = TestClient(a)
    sid = ca.post("/v1/sessions", json={}).json()["id"]
    acks = run_turns(ca, sid, TURNS)
    assert [x["turn"] for x in acks] == [0, 1, 2, 3] and all(x["persisted"] for x in acks)
    assert acks[0]["reply"]["finish_reason"] == "length" and acks[3]["reply"] is None
    state = ca.get(f"/v1/sessions/{sid}").json()
    # messages: 2 + reply, tool + reply, user + reply, tool + user = 9; the tool output (message 3) was dropped
    assert state["n_messages"] == 9 and state["dropped_messages"] == [3]
    assert state["messages"][2] == {"role": "assistant", "content": acks[0]["reply"]["content"]}
    live = live_session(a, sid).session
    assert live.resident < live.n_logical

    b = app(engine, tmp_path)  # a restart: a new app on the same data dir
    cb = TestClient(b)
    assert cb.get("/v1/sessions").json()["data"] == [{"id": sid, "object": "session"}]
    rebuilt_state = cb.get(f"/v1/sessions/{sid}").json()
    assert rebuilt_state == state
    rebuilt = live_session(b, sid).session
    assert rebuilt.history == live.history
    assert torch.equal(rebuilt.last_logits, live.last_logits)  # bitwise: the same forwards in the same order
    assert rebuilt.resident_positions().tolist() == live.resident_positions().tolist()
    # an independent check of the state itself: transformers' cache replaying the same history
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    torch.testing.assert_close(ref.replay(live.history)[-1], live.last_logits, atol=5e-5, rtol=1e-4)
    # both continue identically
    nxt = {"messages": [{"role": "user", "content": "And then?"}], "max_tokens": 5}
    assert run_turns(ca, sid, [nxt])[0] == run_turns(cb, sid, [nxt])[0]
    assert b.state.metrics.rebuild_seconds._sum.get() > 0


def test_refused_turn_leaves_the_session_unchanged(engine, tmp_path):
    c = TestClient(app(engine, tmp_path))
    sid = c.post("/v1/sessions", json={}).json()["id"]
    run_turns(c, sid, TURNS[:2])
    before = c.get(f"/v1/sessions/{sid}").json()
    bad = [
        ({"messages": [{"role": "user", "content": "x"}], "cache": {"drop": {"4": [0, 1, 2, 3, 4]},
                                                                    "reposition": [4]}},
         "reposition on an empty cache"),  # refused by the engine after the append ran: rolled back
        ({"messages": [{"role": "user", "content": "x"}], "cache": {"drop": {"1": [0]}}}, "already passed"),
        ({"messages": [{"role": "user", "content": "x"}], "cache": {"drop": {"4": [5]}}}, "not yet appended"),
        ({"messages": [{"role": "user", "content": "x"}], "cache": {"drop": {"4": [9]}}}, "message 9 is unknown"),
        ({}, "nothing to do"),
    ]
    for body, match in bad:
        r = c.post(f"/v1/sessions/{sid}/messages", json=body)
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    assert c.get(f"/v1/sessions/{sid}").json() == before
    assert c.post(f"/v1/sessions/{sid}/messages", json={"cache": {"drop": {"4": [3]}}}).status_code == 200
    r = c.post(f"/v1/sessions/{sid}/messages", json={"cache": {"drop": {"4": [3]}}})
    assert r.status_code == 400 and "already dropped" in r.json()["error"]["message"]
    assert c.get("/v1/sessions/sess_000000000000000000000000").status_code == 404
    assert c.get("/v1/sessions/../../etc").status_code == 404
    r = c.post("/v1/sessions", json={"policy": "pace", "budget": 16, "limit": 20})
    assert r.status_code == 400 and "must exceed budget" in r.json()["error"]["message"]
    r = c.post("/v1/sessions", json={"blueprint": [{"message": 1, "readers": [2]}]})
    assert r.status_code == 400 and "token spans" in r.json()["error"]["message"]


def test_torn_trailing_line_is_cut_off(engine, tmp_path):
    c = TestClient(app(engine, tmp_path))
    sid = c.post("/v1/sessions", json={"policy": "h2o", "budget": 40}).json()["id"]
    acks = run_turns(c, sid, TURNS[:2])
    log = tmp_path / "sessions" / f"{sid}.jsonl"
    good = log.read_bytes()
    with open(log, "ab") as f:
        f.write(b'{"type": "turn", "turn": 2, "messages": [{"ro')  # killed mid-write: never acknowledged
    c2 = TestClient(app(engine, tmp_path))
    state = c2.get(f"/v1/sessions/{sid}").json()
    assert state["turns"] == 2 and state["history_key"] == acks[-1]["history_key"]
    assert state["config"]["policy"] == "h2o" and state["resident_tokens"] <= 40 + 4
    assert log.read_bytes() == good
    assert run_turns(c2, sid, TURNS[2:3])[0]["turn"] == 2


def test_a_log_from_another_model_is_refused(engine, tmp_path):
    from kvsteward.models import tiny_model
    from kvsteward.serve.engine import Engine

    c = TestClient(app(engine, tmp_path))
    sid = c.post("/v1/sessions", json={}).json()["id"]
    run_turns(c, sid, TURNS[:1])
    other = Engine(tiny_model("llama", seed=5, vocab=len(engine.tokenizer)), engine.tokenizer)
    r = TestClient(app(other, tmp_path)).get(f"/v1/sessions/{sid}")
    assert r.status_code == 500 and "was created with model" in r.json()["error"]["message"]
    assert TestClient(app(engine, tmp_path)).get(f"/v1/sessions/{sid}").status_code == 200


def test_idle_sessions_unload_and_rebuild_on_demand(engine, tmp_path):
    a = app(engine, tmp_path, session_bytes=1)  # every idle session unloads
    c = TestClient(a)
    sids = [c.post("/v1/sessions", json={}).json()["id"] for _ in range(3)]
    keys = {sid: run_turns(c, sid, TURNS[:2])[-1]["history_key"] for sid in sids}
    assert a.state.metrics.sessions_active._value.get() == 0
    assert a.state.metrics.session_unloads._value.get() > 0
    for sid in sids:
        assert c.get(f"/v1/sessions/{sid}").json()["history_key"] == keys[sid]
    assert c.delete(f"/v1/sessions/{sids[0]}").json()["deleted"] is True
    assert c.get(f"/v1/sessions/{sids[0]}").status_code == 404
    assert not (tmp_path / "sessions" / f"{sids[0]}.jsonl").exists()
    assert len(c.get("/v1/sessions").json()["data"]) == 2


def _wait_healthy(url: str, proc, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx2.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not come up")


@pytest.mark.slow  # two server processes (torch import + model load each): ~20-40 s on 2 busy cores
def test_kill_9_loses_no_acknowledged_turn(engine, tmp_path):
    model_dir = tmp_path / "model"
    engine.model.save_pretrained(model_dir)
    engine.tokenizer.save_pretrained(model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvsteward.pipelines.cli_serve", "--model", str(model_dir), "--port", str(port),
           "--data-dir", str(tmp_path / "data"), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVSTEWARD_HOME": str(tmp_path / "home")}

    def start():
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_healthy(url, proc)
        return proc

    proc = start()
    try:
        sid = httpx2.post(url + "/v1/sessions", json={}).json()["id"]
        acks = [httpx2.post(f"{url}/v1/sessions/{sid}/messages", json=t, timeout=60).json() for t in TURNS[:3]]
        inflight = threading.Thread(target=lambda: _swallow(lambda: httpx2.post(
            f"{url}/v1/sessions/{sid}/messages", json={"messages": [{"role": "user", "content": "go"}],
                                                       "max_tokens": 3000}, timeout=60)))
        inflight.start()
        time.sleep(1.0)  # the long turn is decoding when the process dies
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    inflight.join()
    proc = start()
    try:
        state = httpx2.get(f"{url}/v1/sessions/{sid}", timeout=120).json()
        assert state["turns"] == 3  # every acknowledged turn; the in-flight one was never persisted
        assert state["history_key"] == acks[-1]["history_key"]
        replies = [m["content"] for m in state["messages"] if m["role"] == "assistant"]
        assert replies == [a["reply"]["content"] for a in acks]
        r = httpx2.post(f"{url}/v1/sessions/{sid}/messages", json=TURNS[3], timeout=60)
        assert r.status_code == 200 and r.json()["turn"] == 3
        text = httpx2.get(url + "/metrics").text
        assert "kvsteward_session_rebuild_seconds_count 1.0" in text
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _swallow(fn):
    try:
        fn()
    except httpx2.HTTPError:
        pass
