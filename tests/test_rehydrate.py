"""Tiered rehydration (PACE): evicted planned spans come back from a storage tier when their reader step opens.

Every check compares against an independent path: the reference session (transformers' DynamicCache, evicted columns
kept aside and put back, float64 rotations written there), the metadata simulation of the history, and the same
session run without spilling or with another tier.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.policies import get_policy
from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.engine.restore import plan_history
from kvsteward.serve.engine.session import EVICTED, RESIDENT, Session, SessionConfig
from kvsteward.serve.engine.spill import SpillError, SpillStore, host_store
from kvsteward.serve.engine.tiers import DiskTier, HostTier, ValkeyTier, load_snapshot, snapshot

torch.set_num_threads(1)

B, H, L = 48, 16, 128
SPAN = 24  # three planned messages of 24 tokens: 72 planned tokens never fit B = 48 together
READERS = (20, 25, 30)
BLUEPRINT = [{"span": [i * SPAN, (i + 1) * SPAN], "readers": [r]} for i, r in enumerate(READERS)]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama", seed=3, layers=2, max_positions=1 << 14))


def _messages(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (SPAN if i < 3 else 16,), generator=gen).tolist() for i in range(n)]


def _play(s: Session, msgs: list[list[int]]) -> list[torch.Tensor]:
    return [s.append(m, logits="last").clone() for m in msgs]


# the same three spans on messages 10-12 (16 tokens each, logical 184..232): spilled after the first renumbers, so
# their blobs carry fp32 reference keys
LATE = [{"span": [184 + 16 * i, 200 + 16 * i], "readers": [r]} for i, r in enumerate(READERS)]


def _tiered(engine: Engine, spill: SpillStore | None = None, bounded: bool = True, blueprint=BLUEPRINT) -> Session:
    from kvsteward.serve.engine.blueprint import parse_blueprint

    pol = get_policy("foresight", sinks=4, recent=8)
    return Session(engine, SessionConfig(policy=pol, budget=B, chunk=H, limit=L if bounded else None,
                                         blueprint=parse_blueprint(blueprint), spill=spill or host_store()))


def _span(i: int) -> set[int]:
    return set(range(i * SPAN, (i + 1) * SPAN))


@pytest.mark.parametrize("late", [False, True], ids=["spilled-before-renumber", "spilled-with-reference-keys"])
def test_evicted_span_comes_back_at_its_reader_and_matches_reference(engine, late):
    s = _tiered(engine, blueprint=LATE if late else BLUEPRINT)
    span = set(range(*LATE[2]["span"])) if late else _span(2)
    msgs = _messages(31)
    _play(s, msgs[:30])
    assert any(s.status[i] == EVICTED for i in span), "the test needs span 2 evicted before its reader"
    keys = {s.spilled[i] for i in span if i in s.spilled}
    has_ref = {"ref_k.0" in rows for rows in s.config.spill.fetch(sorted(keys)).values()}
    assert has_ref == {late}
    got = s.append(msgs[30], logits="all")  # step 30 reads span 2
    assert span <= set(s.resident_logical().tolist())
    assert {"op": "rehydrate", "indices": sorted(i for i in span if i in _rehydrated(s))} in s.history
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    want = ref.replay(s.history)
    assert ref.logical == s.resident_logical().tolist() and ref.positions == s.resident_positions().tolist()
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
    plan = plan_history(s.history)  # the metadata simulation agrees on who is resident where
    assert plan.resident == s.resident_logical().tolist() and plan.final_pos == s.resident_positions().tolist()
    assert int(s.resident_positions().max()) < L and s.peak_resident <= B + H


def _rehydrated(s: Session) -> set[int]:
    return {i for op in s.history if op["op"] == "rehydrate" for i in op["indices"]}


def test_without_spill_the_span_is_lost(engine):
    s = engine.session("pace", budget=B, chunk=H, limit=L, blueprint=BLUEPRINT, sinks=4, recent=8)
    _play(s, _messages(31))
    assert not _span(2) <= set(s.resident_logical().tolist())
    t = engine.session("pace-tiered", budget=B, chunk=H, limit=L, blueprint=BLUEPRINT, sinks=4, recent=8)
    _play(t, _messages(31))
    assert _span(2) <= set(t.resident_logical().tolist())


def test_unbounded_keeps_positions_and_after_reposition_renumbers(engine):
    s = _tiered(engine, bounded=False)
    msgs = _messages(31)
    _play(s, msgs[:30])
    got = s.append(msgs[30], logits="all")
    pos = s.resident_positions()
    assert bool((pos[1:] > pos[:-1]).all()) and s.renumbers == 0  # positions kept: no renumber needed
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    torch.testing.assert_close(got, ref.replay(s.history), atol=5e-5, rtol=1e-4)

    r = _tiered(engine, bounded=False)  # a reposition puts the residents at 0..r-1, below where span 2 left:
    _play(r, msgs[:30])  # back at its old positions it would be out of logical order, so everyone is renumbered
    r.reposition()
    got = r.append(msgs[30], logits="all")
    at = max(i for i, op in enumerate(r.history) if op["op"] == "rehydrate")
    assert r.history[at + 1] == {"op": "renumber"} and r.renumbers == 2
    pos = r.resident_positions()
    assert bool((pos[1:] > pos[:-1]).all())
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    want = ref.replay(r.history)
    assert ref.positions == r.resident_positions().tolist()
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_store_is_bounded_by_the_plan_and_forks_share_blobs(engine):
    store = host_store()
    s = _tiered(engine, spill=store)
    msgs = _messages(40)
    _play(s, msgs[:30])
    assert store.held_keys() > 0 and store.stats.bytes_held > 0
    held = store.held_keys()
    f = s.fork()
    assert store.held_keys() == held  # a fork shares the blobs
    got_f = f.append(msgs[30], logits="all")
    got_s = s.append(msgs[30], logits="all")
    torch.testing.assert_close(got_f, got_s, atol=0, rtol=0)
    del f
    gc.collect()
    _play(s, msgs[31:40])  # past every reader: nothing planned is left to keep
    assert not s.spilled and store.held_keys() == 0 and store.stats.bytes_held == 0
    assert store.stats.peak_bytes < 3 * SPAN * engine.kv_bytes_per_token() * 3  # planned tokens only (+ ref keys)


def test_discarded_session_releases_its_blobs(engine):
    store = host_store()
    s = _tiered(engine, spill=store)
    _play(s, _messages(29))
    assert store.held_keys() > 0
    del s
    gc.collect()
    assert store.held_keys() == 0 and store.stats.bytes_held == 0 and not store.tier._blobs


def test_lost_blob_raises_and_leaves_the_session_unchanged(engine):
    s = _tiered(engine)
    msgs = _messages(31)
    _play(s, msgs[:30])
    key = s.spilled[min(i for i in _span(2) if i in s.spilled)]
    blob = s.config.spill.tier.get(key)
    s.config.spill.tier.delete(key)
    before = (list(s.history), s.n_messages, s.resident_logical().tolist(), dict(s.spilled))
    with pytest.raises(SpillError, match="missing"):
        s.append(msgs[30])
    assert (s.history, s.n_messages, s.resident_logical().tolist(), s.spilled) == before
    s.config.spill.tier.put(key, blob)  # the tier answers again: the same append now works
    s.append(msgs[30])
    assert _span(2) <= set(s.resident_logical().tolist())


def test_drop_of_a_spilled_token_is_final(engine):
    s = _tiered(engine)
    msgs = _messages(31)
    _play(s, msgs[:30])
    gone = sorted(i for i in _span(2) if i in s.spilled)[:5]
    s.drop(gone)
    assert not set(gone) & set(s.spilled)
    s.append(msgs[30])
    resident = set(s.resident_logical().tolist())
    assert not set(gone) & resident and (_span(2) - set(gone)) <= resident


@pytest.mark.parametrize("tier", ["disk", "valkey"])
def test_disk_and_valkey_tiers_rehydrate_bit_identically(engine, tmp_path, tier, request):
    backend = DiskTier(tmp_path / "spill") if tier == "disk" else ValkeyTier(request.getfixturevalue("valkey_url"),
                                                                              prefix="kvsteward:spill:")
    host, other = _tiered(engine), _tiered(engine, spill=SpillStore(backend))
    msgs = _messages(31)
    a, b = _play(host, msgs), _play(other, msgs)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert host.history == other.history and other.config.spill.stats.fetches >= 1


def test_snapshot_carries_spilled_kv_to_a_fresh_store(engine):
    s = _tiered(engine)
    msgs = _messages(31)
    _play(s, msgs[:30])
    assert s.spilled
    blob = snapshot(s)
    fresh = SpillStore(HostTier())  # another process: the old store is gone
    cfg = SessionConfig(**{**s.config.__dict__, "spill": fresh})
    t = load_snapshot(engine, cfg, blob)
    assert t.spilled.keys() == s.spilled.keys()
    torch.testing.assert_close(t.append(msgs[30], logits="all"), s.append(msgs[30], logits="all"), atol=0, rtol=0)
    assert t.history == s.history


def test_server_replay_rederives_rehydration(engine):
    from kvsteward.serve.server.store import replay

    s = _tiered(engine)
    msgs = _messages(31)
    _play(s, msgs)
    r = _tiered(engine)
    replay(r, [op for op in s.history if op["op"] in ("append", "drop", "reposition")])
    assert r.history == s.history
    torch.testing.assert_close(r.last_logits, s.last_logits, atol=0, rtol=0)
    assert all(r.status[i] == RESIDENT for i in _span(2))


def test_spill_needs_an_evicting_policy(engine):
    from kvsteward.serve.engine.session import CacheOpError

    with pytest.raises(CacheOpError, match="spill store needs an evicting policy"):
        Session(engine, SessionConfig(policy=get_policy("full"), spill=host_store()))


# -- the server: a pace-tiered request rehydrates, in any spill tier, and rebuilds identically after a restart ------
CHAT = [{"role": "system", "content": "You are a careful agent."}] + [
    {"role": "user" if i % 2 else "assistant",
     "content": f"Note {i}: the value of key_{i} is {1000 + 37 * i}; " + "filler words here " * 6}
    for i in range(1, 12)]
# messages 1-3 are planned (readers 9, 10, 11): ~60 tokens each never fit beside the 68 protected slots in B = 160
CHAT_PLAN = [{"message": 1, "readers": [11]}, {"message": 2, "readers": [9]}, {"message": 3, "readers": [10]}]


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.parametrize("spill_tier", ["host", "disk"])
def test_server_pace_tiered_rehydrates_and_matches_across_tiers(tmp_path, spill_tier):
    from starlette.testclient import TestClient

    from kvsteward.serve.server.api import ServerConfig, create_app
    from kvsteward.serve.server.testing import tiny_chat_engine

    engine = tiny_chat_engine(seed=2)
    body = {"messages": CHAT, "max_tokens": 4, "policy": "pace-tiered", "budget": 160, "limit": 1024,
            "blueprint": CHAT_PLAN}
    got = {}
    for tier in ("host", spill_tier):
        c = TestClient(create_app(engine, ServerConfig(data_dir=tmp_path / tier, spill_tier=tier)))
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        got[tier] = r.json()
        assert _metric(c, "kvsteward_rehydrated_tokens_total") > 0
        assert _metric(c, f'kvsteward_rehydrate_seconds_count{{tier="{tier}"}}') >= 1
    assert got["host"]["choices"][0]["message"] == got[spill_tier]["choices"][0]["message"]
    assert got["host"]["kvsteward"]["history_key"] == got[spill_tier]["kvsteward"]["history_key"]
    c = TestClient(create_app(engine, ServerConfig(data_dir=tmp_path / "plain")))
    plain = c.post("/v1/chat/completions", json={**body, "policy": "pace"}).json()
    assert plain["kvsteward"]["history_key"] != got["host"]["kvsteward"]["history_key"]
    assert _metric(c, "kvsteward_rehydrated_tokens_total") == 0


def test_bench_rehydrate_reports_every_tier(engine, valkey_url, tmp_path):
    from kvsteward.serve.bench.checks import bench_rehydrate

    out = bench_rehydrate(engine, span_tokens=40, filler_messages=4, budget=96, chunk=32, limit=256,
                          valkey_url=valkey_url, repeats=1, disk_dir=str(tmp_path))
    assert out["rehydrated_tokens"] > 0 and out["spilled_bytes"] > 0
    assert all(out[f"{t}_s"] > 0 for t in ("host", "disk", "valkey"))


# -- property: random op sequences with a random blueprint ---------------------------------------------------------
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_append = st.tuples(st.just("append"), st.integers(3, 20))
ops_strategy = st.lists(st.one_of(_append, _append, _append, st.tuples(st.just("drop"), st.floats(0.05, 0.5)),
                                  st.tuples(st.just("reposition"), st.just(0.0))), min_size=8, max_size=16)
# (possibly overlapping) spans over the first ~50 tokens, read by steps 2..9: together they outgrow
# B - protected = 10, so planned tokens are evicted and come back
plan_strategy = st.lists(st.tuples(st.integers(0, 40), st.integers(4, 14), st.lists(st.integers(2, 9), min_size=1,
                                                                                  max_size=3)),
                         min_size=2, max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops_strategy, plan=plan_strategy, bounded=st.booleans(), seed=st.integers(0, 10_000))
def test_random_histories_with_rehydration_match_reference(engine, ops, plan, bounded, seed):
    """Any mix of appends (each a new step), drops and repositions on a tiered foresight session with a random
    blueprint: the final state and logits equal the reference replay of its history, the history simulation agrees,
    every rehydrated token belongs to a span its step reads, resident never exceeds B + H, and the server's
    log replay re-derives the same history."""
    from kvsteward.serve.engine.blueprint import parse_blueprint
    from kvsteward.serve.server.store import replay

    blueprint = parse_blueprint([{"span": [a, a + n], "readers": r} for a, n, r in plan])
    config = dict(policy=get_policy("foresight", sinks=2, recent=4), budget=16, chunk=8,
                  limit=64 if bounded else None, blueprint=blueprint)
    s = Session(engine, SessionConfig(**config, spill=host_store()))
    gen = torch.Generator().manual_seed(seed)
    s.append(torch.randint(0, 256, (10,), generator=gen).tolist())
    for op, arg in ops:
        if op == "append":
            s.append(torch.randint(0, 256, (int(arg),), generator=gen).tolist())
        elif op == "drop":
            resident = s.resident_logical().tolist()
            k = min(len(resident) - 1, int(len(resident) * arg))
            if k > 0:
                s.drop(sorted(resident[i] for i in torch.randperm(len(resident), generator=gen)[:k].tolist()))
        elif s.resident:
            s.reposition()
        assert s.resident <= 16 + 8
    final = s.append([5, 6, 7], logits="all")
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    want = ref.replay(s.history)
    assert ref.logical == s.resident_logical().tolist() and ref.positions == s.resident_positions().tolist()
    torch.testing.assert_close(final, want, atol=5e-5, rtol=1e-4)
    plan_state = plan_history(s.history)
    assert plan_state.resident == ref.logical and plan_state.final_pos == ref.positions
    step = -1
    for op in s.history:
        if op["op"] == "append":
            step = op["step"]
        if op["op"] == "rehydrate":  # recorded before the step's first append: it serves the next step
            nxt = step + 1
            assert all(any(sp.start <= i < sp.end and nxt in sp.readers for sp in blueprint) for i in op["indices"])
    event(f"rehydrations: {min(sum(op['op'] == 'rehydrate' for op in s.history), 2)}")
    again = Session(engine, SessionConfig(**config, spill=host_store()))
    replay(again, [op for op in s.history if op["op"] in ("append", "drop", "reposition")])
    assert again.history == s.history
