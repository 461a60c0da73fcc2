"""Storage tiers: a state moved through host → disk → Valkey/Redis comes back bit for bit and continues identically."""

from __future__ import annotations

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.tiers import DiskTier, HostTier, TieredStore, ValkeyTier, load_snapshot, snapshot

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama", seed=8))


def _session(engine):
    s = engine.session("pace", budget=24, chunk=8, limit=48, blueprint=[{"span": [0, 4], "readers": [5]}])
    for i in range(6):
        s.append(torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(i)).tolist(),
                 kind="tool" if i % 2 else "user")
    s.drop(s.resident_logical()[5:7].tolist())
    assert s.renumbers > 0 and s.table.ref_k is not None
    return s


def _same(a, b):
    n = a.table.n
    assert n == b.table.n and a.history == b.history and a.tokens == b.tokens and a.status == b.status
    assert (a.next_pos, a.n_messages, a.current_step) == (b.next_pos, b.n_messages, b.current_step)
    for i in range(a.table.n_layers):
        assert torch.equal(a.table.k[i][:, :n], b.table.k[i][:, :n])
        assert torch.equal(a.table.v[i][:, :n], b.table.v[i][:, :n])
        assert torch.equal(a.table.ref_k[i][:, :n], b.table.ref_k[i][:, :n])
    for name in a.table.meta:
        assert torch.equal(a.table.field(name), b.table.field(name)), name
    assert torch.equal(a.last_logits, b.last_logits)


def test_snapshot_round_trip_is_bit_exact_and_continues_identically(engine):
    s = _session(engine)
    r = load_snapshot(engine, s.config, snapshot(s))
    _same(s, r)
    nxt = [3, 1, 4, 1, 5]
    assert torch.equal(r.append(nxt, logits="all"), s.append(nxt, logits="all"))
    assert r.resident_logical().tolist() == s.resident_logical().tolist()


def test_demote_through_every_tier_and_fetch_back(engine, tmp_path, valkey_url):
    s = _session(engine)
    store = TieredStore([HostTier(), DiskTier(tmp_path / "disk"), ValkeyTier(valkey_url)])
    store.put("sess-1", s)
    assert store.where("sess-1") == 0
    assert store.demote("sess-1") == 1 and store.demote("sess-1") == 2 and store.demote("sess-1") == 2
    assert store.tiers[0].get("sess-1") is None and store.tiers[1].get("sess-1") is None
    got = store.fetch("sess-1", engine, s.config)
    assert got.tier == "valkey" and got.seconds > 0
    _same(s, got.session)
    assert store.where("sess-1") == 0  # promoted back to the top tier
    with pytest.raises(KeyError, match="no tier holds"):
        store.fetch("missing", engine, s.config)


def test_disk_tier_refuses_path_like_keys(tmp_path):
    with pytest.raises(ValueError, match="alphanumeric"):
        DiskTier(tmp_path).put("../escape", b"x")


def test_server_moves_idle_sessions_to_disk_and_restores_them_bit_exactly(tmp_path):
    """A server that unloads every idle session (host tier of 0 bytes: straight to disk) answers exactly like one
    that kept them loaded; a tier copy that does not match the log is discarded (rebuild); after a restart the disk
    copy is used."""
    from starlette.testclient import TestClient

    from kvsteward.serve.server.api import ServerConfig, create_app
    from kvsteward.serve.server.testing import tiny_chat_engine

    eng = tiny_chat_engine(seed=6)
    turns = [{"messages": [{"role": "user", "content": "List files."}], "max_tokens": 4},
             {"messages": [{"role": "tool", "content": "a.py b.py " * 8}], "max_tokens": 3},
             {"messages": [{"role": "user", "content": "Open a.py"}], "cache": {"drop": {"4": [3]}}, "max_tokens": 5},
             {"messages": [{"role": "tool", "content": "print('hi')"}], "max_tokens": 2}]
    kept = create_app(eng, ServerConfig(data_dir=tmp_path / "kept", tiers=False))
    moved = create_app(eng, ServerConfig(data_dir=tmp_path / "moved", session_bytes=1, host_tier_bytes=0))
    ck, cm = TestClient(kept), TestClient(moved)
    body = {"policy": "h2o", "budget": 40}
    sk, sm = ck.post("/v1/sessions", json=body).json()["id"], cm.post("/v1/sessions", json=body).json()["id"]
    store, metrics = moved.state.store, moved.state.metrics
    for t in turns:
        a, b = ck.post(f"/v1/sessions/{sk}/messages", json=t).json(), cm.post(f"/v1/sessions/{sm}/messages",
                                                                              json=t).json()
        assert {**a, "id": None} == {**b, "id": None}
        assert store._records[sm].session is None and store.tiers.where(sm) == "disk"
    assert metrics.tier_restores.labels("disk")._value.get() == len(turns)  # the empty new session went too
    assert metrics.rebuild_seconds._sum.get() == 0  # never replayed: every load came from the disk tier
    assert metrics.tier_bytes.labels("disk")._value.get() > 0 and metrics.tier_bytes.labels("host")._value.get() == 0

    def loaded(app, sid):
        rec = app.state.store.acquire(sid)
        app.state.store.release(rec)
        return rec

    kept_s = loaded(kept, sk).session
    rec = store.acquire(sm)  # held: released, it would be unloaded again at once
    try:
        assert rec.session.history == kept_s.history
        assert torch.equal(rec.session.last_logits, kept_s.last_logits)  # bit-identical next-token logits
        nxt = [5, 6, 7]  # and after one more append too
        assert torch.equal(rec.session.fork().append(nxt), kept_s.fork().append(nxt))
    finally:
        store.release(rec)

    # a tier copy whose history is not the persisted one is discarded: rebuilt from the log instead
    store._records[sm].unloaded_key = "0" * 64
    assert cm.get(f"/v1/sessions/{sm}").json()["history_key"] == kept_s.history_key()
    assert metrics.tier_stale._value.get() == 1 and metrics.rebuild_seconds._sum.get() > 0

    # a restart: the disk copy left by the last unload is adopted and used (checked against the log)
    again = create_app(eng, ServerConfig(data_dir=tmp_path / "moved", session_bytes=1, host_tier_bytes=0))
    state = TestClient(again).get(f"/v1/sessions/{sm}").json()
    assert state["history_key"] == kept_s.history_key() and state["turns"] == len(turns)
    assert again.state.metrics.tier_restores.labels("disk")._value.get() == 1
    assert again.state.metrics.rebuild_seconds._sum.get() == 0
    # deleting the session removes its tier copy
    assert TestClient(again).delete(f"/v1/sessions/{sm}").status_code == 200
    assert again.state.store.tiers.where(sm) is None and not list((tmp_path / "moved" / "tiers").glob("*.kvstate"))


def test_server_tier_budgets_push_states_down_to_valkey(tmp_path, valkey_url):
    """Host and disk budgets of 0 bytes: an unloaded session goes through host and disk down to Valkey, and comes
    back from there unchanged."""
    from starlette.testclient import TestClient

    from kvsteward.serve.server.api import ServerConfig, create_app
    from kvsteward.serve.server.testing import tiny_chat_engine

    eng = tiny_chat_engine(seed=6)
    app = create_app(eng, ServerConfig(data_dir=tmp_path, session_bytes=1, host_tier_bytes=0, disk_tier_bytes=0,
                                       valkey_url=valkey_url))
    c = TestClient(app)
    sid = c.post("/v1/sessions", json={}).json()["id"]
    ack = c.post(f"/v1/sessions/{sid}/messages", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3}).json()
    tiers, m = app.state.store.tiers, app.state.metrics
    assert tiers.where(sid) == "valkey" and not list((tmp_path / "tiers").glob("*.kvstate"))
    assert [m.tier_stores.labels(t)._value.get() for t in ("host", "disk", "valkey")] == [2, 2, 2]
    assert c.get(f"/v1/sessions/{sid}").json()["history_key"] == ack["history_key"]
    assert m.tier_restores.labels("valkey")._value.get() == 2 and m.rebuild_seconds._sum.get() == 0
    c.delete(f"/v1/sessions/{sid}")
    assert tiers.where(sid) is None
