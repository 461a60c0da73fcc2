"""Refresh: the resident tokens re-encoded afresh at 0..r-1. Checked against a new session that holds only those
tokens (same code path: bit-equal K/V and logits), transformers' own cache (the reference replay, over random op
sequences), and a shared fork that must not see the parent's refresh."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.engine.restore import plan_history, restore
from kvsteward.serve.engine.session import CacheOpError

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engine(request) -> Engine:
    return Engine(tiny_model(request.param, seed=3))


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _evicted_session(engine: Engine, chunk: int = 8):
    """An h2o session that has evicted, dropped and renumbered: its K/V carry what it no longer holds."""
    s = engine.session("positions-only", budget=24, chunk=chunk, limit=64)
    for i in range(9):
        s.append(rand_tokens(11, seed=i), kind="tool" if i % 2 else "user")
    s.drop(s.resident_logical()[[5, 6, 9]].tolist())
    assert s.renumbers and "evict" in {op["op"] for op in s.history}
    return s


def test_refresh_equals_a_new_session_of_the_resident_tokens(engine):
    s = _evicted_session(engine)
    before = {name: s.table.field(name).clone() for name in ("logical", "step", "is_tool", "cumulative")}
    resident = s.table.field("token").tolist()
    s.refresh()
    fresh = engine.session("full", chunk=8)
    fresh.append(resident)
    r = len(resident)
    assert s.resident == r and s.next_pos == r and s.resident_positions().tolist() == list(range(r))
    for name, want in before.items():
        assert torch.equal(s.table.field(name), want)  # the metadata the policy reads is kept
    for layer in range(engine.n_layers):
        assert torch.equal(s.table.k[layer][:, :r], fresh.table.k[layer][:, :r])
        assert torch.equal(s.table.v[layer][:, :r], fresh.table.v[layer][:, :r])
    assert torch.equal(s.last_logits, fresh.last_logits)
    assert s.history[-1] == {"op": "refresh"} and s.refreshes == 1
    y = rand_tokens(6, seed=99)
    torch.testing.assert_close(s.append(y, logits="all"), fresh.append(y, logits="all"), atol=2e-5, rtol=1e-4)


def test_refresh_changes_what_eviction_left_behind(engine):
    """Kept K/V of an evicting session differ from fresh ones (they saw evicted tokens): the refresh is not a no-op."""
    s = _evicted_session(engine)
    k_before = s.table.k[1][:, : s.resident].clone()
    s.refresh()
    assert not torch.allclose(k_before, s.table.k[1][:, : s.resident], atol=1e-3)


def test_shared_fork_keeps_reading_the_state_before_the_refresh(engine):
    s = _evicted_session(engine)
    reader, copy = s.fork(shared=True), s.fork()
    s.refresh()
    y = rand_tokens(5, seed=7)
    torch.testing.assert_close(reader.append(y, logits="all"), copy.append(y, logits="all"), atol=2e-5, rtol=1e-4)


def test_refresh_on_an_empty_session_is_refused_and_restore_refuses_a_refreshed_history(engine):
    s = engine.session("full")
    with pytest.raises(CacheOpError, match="empty cache"):
        s.refresh()
    assert s.history == []
    s.append(rand_tokens(9, seed=1))
    s.refresh()
    with pytest.raises(ValueError, match="replaying its ops"):
        restore(engine, s.config, s.history)
    plan = plan_history(s.history)
    assert plan.final_pos == list(range(9)) and plan.next_pos == 9


op_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 12)),
        st.tuples(st.just("drop"), st.floats(0.05, 0.6)),
        st.tuples(st.just("reposition"), st.just(0)),
        st.tuples(st.just("refresh"), st.just(0)),
    ),
    min_size=1, max_size=8,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=op_strategy, seed=st.integers(0, 10_000))
def test_random_op_sequences_with_refresh_match_the_reference(engine, ops, seed):
    rng = torch.Generator().manual_seed(seed)
    s = engine.session("full", chunk=5)
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    for sess in (s, ref):
        sess.append(rand_tokens(8, seed))
    for op, arg in ops:
        if op == "append":
            toks = torch.randint(0, 256, (arg,), generator=rng).tolist()
            torch.testing.assert_close(s.append(toks, logits="all"), ref.append(toks), atol=5e-5, rtol=1e-4)
        elif op == "drop":
            resident = s.resident_logical().tolist()
            k = min(len(resident) - 1, max(0, int(len(resident) * arg)))
            if k:
                victims = [resident[i] for i in torch.randperm(len(resident), generator=rng)[:k].tolist()]
                s.drop(victims)
                ref.drop(victims)
        elif op == "reposition":
            s.reposition()
            ref.reposition()
        else:
            s.refresh()
            torch.testing.assert_close(s.last_logits, ref.refresh(), atol=5e-5, rtol=1e-4)
        assert s.resident_logical().tolist() == ref.logical
        assert s.resident_positions().tolist() == ref.positions
    final = rand_tokens(3, seed + 1)
    torch.testing.assert_close(s.append(final, logits="all"), ref.append(final), atol=5e-5, rtol=1e-4)
    replayed = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    torch.testing.assert_close(replayed.replay(s.history)[-1], s.last_logits, atol=5e-5, rtol=1e-4)


def test_pace_refresh_refreshes_when_a_reader_step_opens(engine):
    """The arm refreshes exactly at the openings of planned reader steps, and its history replays on the reference
    (evictions, renumbers and refreshes taken from the history) to the same logits."""
    plan = [{"span": [0, 11], "readers": [4]}, {"span": [22, 33], "readers": [6]}]
    s = engine.session("pace-refresh", budget=24, chunk=8, limit=64, blueprint=plan)
    logits = [s.append(rand_tokens(11, seed=i), logits="last").clone() for i in range(8)]
    refreshes = [op for op in s.history if op["op"] == "refresh"]
    assert refreshes == [{"op": "refresh", "reader": 4}, {"op": "refresh", "reader": 6}] and s.refreshes == 2
    at = s.history.index(refreshes[0])
    assert s.history[at + 1]["op"] == "append" and s.history[at + 1]["step"] == 4
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    torch.testing.assert_close(ref.replay(s.history)[-1], logits[-1], atol=5e-5, rtol=1e-4)
    unplanned = engine.session("pace-refresh", budget=24, chunk=8, limit=64)  # nothing planned: never refreshes
    for i in range(8):
        unplanned.append(rand_tokens(11, seed=i), logits=None)
    assert unplanned.refreshes == 0 and "refresh" not in {op["op"] for op in unplanned.history}



def test_pace_refresh_drops_everything_unplanned_before_it_refreshes(engine):
    """At a reader step's opening, pace-refresh drops every resident token outside the plan, the reader steps'
    messages and the first message, then refreshes: the re-encoded text is the system prompt, the plan and the
    questions that read it, right before the reader step. Checked against the session's own state before the
    opening, pace-refresh-window on the same messages (no drop, the same state before), a new session of what stays, and
    the reference replay."""
    sizes = [6, 13, 3, 9, 5, 3, 2]
    starts = [sum(sizes[:k]) for k in range(len(sizes))] + [sum(sizes)]
    plan = [{"span": [starts[3], starts[3] + 5], "readers": [4, 5]}]  # the head of message 3, read by steps 4 and 5
    s = engine.session("pace-refresh", budget=20, chunk=8, limit=64, blueprint=plan, recent=4, sinks=6)
    plain = engine.session("pace-refresh-window", budget=20, chunk=8, limit=64, blueprint=plan, recent=4, sinks=6)
    for k in range(4):
        for x in (s, plain):
            x.append(rand_tokens(sizes[k], seed=k), kind="tool" if k % 2 else "user", logits=None)
    before = s.resident_logical().tolist()
    assert before == plain.resident_logical().tolist()
    keep = [i for i in before if i < starts[1] or starts[3] <= i < starts[3] + 5]  # message 0 (sinks) and the plan
    assert set(range(starts[1])) | set(range(starts[3], starts[3] + 5)) <= set(before) and len(keep) < len(before)
    for k in (4, 5):
        s.append(rand_tokens(sizes[k], seed=k), logits="last")
        plain.append(rand_tokens(sizes[k], seed=k), logits=None)
    refreshes = [j for j, op in enumerate(s.history) if op["op"] == "refresh"]
    dropped = sorted(set(before) - set(keep))
    assert len(refreshes) == 1 and s.history[refreshes[0] - 1] == {"op": "drop", "indices": dropped}
    # at step 5 nothing is unplanned (step 4 is a reader) and every row is fresh since the refresh: nothing to redo
    assert s.resident_logical().tolist() == keep + list(range(starts[4], starts[6])) and s.fresh_rows == s.resident
    assert plain.refreshes == 2 and "drop" not in {op["op"] for op in plain.history}  # evictions between: refreshed
    fresh = engine.session("full", chunk=8)
    fresh.append([s.tokens[i] for i in keep] + s.tokens[starts[4]:], logits="last")
    torch.testing.assert_close(s.last_logits, fresh.last_logits, atol=5e-5, rtol=1e-4)
    s.append(rand_tokens(sizes[6], seed=6), logits=None)
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    torch.testing.assert_close(ref.replay(s.history)[-1], s.last_logits, atol=5e-5, rtol=1e-4)


def test_server_log_replay_rederives_the_refreshes(engine):
    """The server rebuilds a session from its log by re-running appends and drops (`store.replay`): the session's
    own policy re-derives evictions, renumbers and reader-step refreshes, to the same history and logits; an
    explicit refresh in a log is re-run."""
    from kvsteward.serve.server.store import replay

    plan = [{"span": [0, 11], "readers": [3]}, {"span": [11, 22], "readers": [5]}]
    s = engine.session("pace-refresh", budget=24, chunk=8, limit=64, blueprint=plan)
    for i in range(6):
        s.append(rand_tokens(11, seed=20 + i), logits=None)
    s.refresh()
    s.append(rand_tokens(4, seed=40), logits=None)
    rebuilt = engine.session("pace-refresh", budget=24, chunk=8, limit=64, blueprint=plan)
    replay(rebuilt, s.history)
    assert rebuilt.history == s.history and rebuilt.refreshes == s.refreshes == 3
    assert torch.equal(rebuilt.last_logits, s.last_logits)


def test_server_serves_pace_refresh(tmp_path):
    from starlette.testclient import TestClient

    from kvsteward.serve.server.api import ServerConfig, create_app
    from kvsteward.serve.server.testing import tiny_chat_engine

    chat = [{"role": "system", "content": "You are a careful agent."}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"Note {i}: key_{i} is {1000 + 37 * i}. " * 4}
        for i in range(1, 8)]
    c = TestClient(create_app(tiny_chat_engine(seed=2), ServerConfig(data_dir=tmp_path)))
    body = {"messages": chat, "max_tokens": 4, "policy": "pace-refresh", "budget": 96, "limit": 1024,
            "blueprint": [{"message": 1, "readers": [7, 8]}]}  # message 7 opens inside the prompt
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    pace = c.post("/v1/chat/completions", json={**body, "policy": "pace"})
    assert pace.status_code == 200 and pace.json()["kvsteward"]["history_key"] != r.json()["kvsteward"]["history_key"]
    unplanned = c.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "blueprint"})
    assert unplanned.status_code == 200  # nothing planned: the arm never refreshes
    bad = c.post("/v1/chat/completions", json={**body, "limit": None})
    assert bad.status_code == 400 and "limit" in bad.text  # a bounded arm without L is named


def _fresh_kv_error(engine: Engine, s) -> float:
    """Max |ΔK|, |ΔV| between the session's resident rows and a new session of its resident tokens."""
    fresh = engine.session("full", chunk=s.config.chunk)
    fresh.append(s.table.field("token").tolist())
    r = s.resident
    return max(max(float((s.table.k[i][:, :r] - fresh.table.k[i][:, :r]).abs().max()),
                   float((s.table.v[i][:, :r] - fresh.table.v[i][:, :r]).abs().max())) for i in range(engine.n_layers))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=op_strategy, seed=st.integers(0, 10_000), evicting=st.booleans())
def test_a_tail_refresh_equals_the_full_refresh(engine, ops, seed, evicting):
    """Over random appends, drops, repositions, evictions and renumbers: a tail refresh leaves K/V equal (to rounding)
    to a new session of the resident tokens and to the full refresh of the same state, the same logits, and it
    re-encodes only the rows past the fresh prefix (never more than the full refresh's r)."""
    rng = torch.Generator().manual_seed(seed)
    kw = {"budget": 20, "chunk": 6, "limit": 48} if evicting else {"chunk": 5}
    s = engine.session("positions-only" if evicting else "full", **kw)
    s.append(rand_tokens(8, seed))
    for op, arg in ops:
        if op == "append":
            s.append(torch.randint(0, 256, (arg,), generator=rng).tolist(), kind="tool" if arg % 2 else "user")
        elif op == "drop":
            resident = s.resident_logical().tolist()
            k = min(len(resident) - 1, max(0, int(len(resident) * arg)))
            if k:
                s.drop([resident[i] for i in torch.randperm(len(resident), generator=rng)[:k].tolist()])
        elif op == "reposition":
            s.reposition()
        else:
            full = s.fork()
            full.refresh()
            r, k = s.resident, min(s.fresh_rows, s.resident - 1)
            before = s.refresh_tokens
            s.refresh(tail=True)
            assert s.refresh_tokens - before == r - k and s.fresh_rows == r
            assert s.history[-1] == ({"op": "refresh", "from": k} if k else {"op": "refresh"})
            torch.testing.assert_close(s.last_logits, full.last_logits, atol=5e-5, rtol=1e-4)
            assert s.resident_positions().tolist() == list(range(r)) and s.next_pos == r
            for name in ("logical", "step", "is_tool", "cumulative", "token"):
                assert torch.equal(s.table.field(name), full.table.field(name))
            assert _fresh_kv_error(engine, s) < 5e-5
        assert s.fresh_rows <= s.resident
        if s.fresh_rows:  # the invariant itself: the prefix is what a new session of those tokens computes
            head = engine.session("full", chunk=7)
            head.append(s.table.field("token")[: s.fresh_rows].tolist())
            for i in range(engine.n_layers):
                torch.testing.assert_close(s.table.k[i][:, : s.fresh_rows], head.table.k[i][:, : s.fresh_rows],
                                           atol=5e-5, rtol=1e-4)
    y = rand_tokens(4, seed + 1)
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    torch.testing.assert_close(s.append(y, logits="all")[-1], ref.replay(s.history)[-1], atol=5e-5, rtol=1e-4)


def test_pace_refresh_tail_refreshes_at_the_same_steps_for_less(engine):
    """The tail arm refreshes at the same reader openings as pace-refresh, with the same logits at every step to
    rounding, and re-encodes fewer tokens when the rows before the first eviction stay (the sinks and a planned span
    at the start are never evicted: sinks, recent window and both spans fit B)."""
    plan = [{"span": [4, 24], "readers": [6, 8]}, {"span": [44, 64], "readers": [8]}]
    full = engine.session("pace-refresh", budget=96, chunk=16, limit=256, blueprint=plan, recent=16)
    tail = engine.session("pace-refresh-tail", budget=96, chunk=16, limit=256, blueprint=plan, recent=16)
    for i in range(10):
        toks = rand_tokens(4 if i == 0 else 20, seed=i)
        torch.testing.assert_close(tail.append(toks), full.append(toks), atol=5e-5, rtol=1e-4)
    strip = [{k: v for k, v in op.items() if k != "from"} for op in tail.history]
    assert strip == full.history and tail.refreshes == full.refreshes == 2
    starts = [op.get("from") for op in tail.history if op["op"] == "refresh"]
    assert all(k >= 24 for k in starts)  # the sinks and the first span are never evicted: they stay as encoded
    assert tail.refresh_tokens == full.refresh_tokens - sum(starts) < full.refresh_tokens  # the same r, less k


def test_the_fresh_prefix_holds_through_rehydration(engine):
    """A tiered session spills a planned span, refreshes, and brings the span back: after every step the rows counted
    fresh are what a new session of those tokens computes, and a tail refresh then equals a new session of all
    resident tokens."""
    plan = [{"span": [0, 40], "readers": [8]}, {"span": [40, 80], "readers": [5]}]  # A and B do not fit B together
    s = engine.session("pace-tiered", budget=112, chunk=16, limit=512, blueprint=plan)
    for i in range(9):
        s.append(rand_tokens(40 if i < 2 else 32 if i < 8 else 3, seed=40 + i))
        if i == 6:
            s.refresh()  # every row fresh; the rehydration at step 8 then lands in the middle of them
        if s.fresh_rows:
            head = engine.session("full", chunk=16)
            head.append(s.table.field("token")[: s.fresh_rows].tolist())
            for layer in range(engine.n_layers):
                torch.testing.assert_close(s.table.k[layer][:, : s.fresh_rows],
                                           head.table.k[layer][:, : s.fresh_rows], atol=5e-5, rtol=1e-4)
    assert "rehydrate" in {op["op"] for op in s.history}
    s.refresh(tail=True)
    assert _fresh_kv_error(engine, s) < 5e-5


def test_bench_refresh_reports_both_refreshes_beside_the_forwards(engine):
    """`steward bench refresh`: per size, the session evicted (r = budget), the tail re-encoded r − fresh_rows
    tokens (< r when the first eviction left a prefix), and every timing is a positive number."""
    from kvsteward.serve.bench.checks import bench_refresh

    rows = bench_refresh(engine, sizes=(96, 160), chunk=32, repeats=1)
    assert [row["r"] for row in rows] == [96, 160]
    for row in rows:
        assert row["tail_tokens"] == row["r"] - min(row["fresh_rows"], row["r"] - 1) <= row["r"]
        for key in ("refresh_s", "refresh_tail_s", "engine_prefill_s", "hf_forward_s"):
            assert row[key] > 0
