"""Persistent-session hardening, on the store itself (no HTTP layer): owners (another owner's session is exactly a
missing one; the owner index needs no log parsing), exactly-once turns with an idempotency key (a retry after a kill
right after the fsync returns the stored answer and appends nothing), and torn / empty / corrupt logs (a torn tail is
cut off and kept in `.torn`; a log that cannot load is listed, refused with `CorruptSession`, and deletable)."""

from __future__ import annotations

import json

import pytest
import torch

from kvsteward.serve.engine.ops import SessionSpec
from kvsteward.serve.manager.worker import Scheduler
from kvsteward.serve.server.completions import ServeLimits
from kvsteward.serve.server.metrics import Metrics
from kvsteward.serve.server.store import (
    CorruptSession,
    IdempotencyConflict,
    RebuildError,
    SessionLog,
    SessionNotFound,
    SessionStore,
)
from kvsteward.serve.server.testing import tiny_chat_engine

torch.set_num_threads(1)

FIRST = {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List files."}],
         "max_tokens": 5}
SECOND = {"messages": [{"role": "tool", "content": "a.py b.py c.py " * 4}], "max_tokens": 4}
QUIET = {"messages": [{"role": "user", "content": "Noted."}]}  # no reply: cheap
GHOST = "sess_" + "0" * 24


@pytest.fixture(scope="module")
def engine():
    return tiny_chat_engine(seed=2)


def make_store(engine, path) -> SessionStore:
    """A store as `create_app` builds it (a fresh one over the same path = a restart)."""
    return SessionStore(path / "sessions", engine, SessionSpec(), Scheduler(), Metrics(), 4 << 30, ServeLimits())


def log_path(path, sid):
    return path / "sessions" / f"{sid}.jsonl"


def log_records(path, sid) -> list[dict]:
    return [json.loads(x) for x in log_path(path, sid).read_text().splitlines()]


def turn_records(path, sid) -> list[dict]:
    return [r for r in log_records(path, sid) if r["type"] == "turn"]


def describe(store, sid, owner=None) -> dict:
    rec = store.acquire(sid, owner=owner)
    try:
        return rec.describe()
    finally:
        store.release(rec)


def not_found(fn, sid):
    with pytest.raises(SessionNotFound) as e:
        fn()
    assert e.value.args == (sid,)  # the same error as a missing session: nothing tells the other owner's apart


# -- ownership ------------------------------------------------------------------------------------------------------
def test_owners_see_only_their_sessions(engine, tmp_path, monkeypatch):
    store = make_store(engine, tmp_path)
    a = store.create({}, owner="alice").id
    b = store.create({}, owner="bob").id
    anon = store.create({}).id
    assert log_records(tmp_path, a)[0]["owner"] == "alice" and log_records(tmp_path, anon)[0]["owner"] is None
    assert store.ids() == sorted([a, b, anon])
    assert store.ids("alice") == [a] and store.ids("bob") == [b] and store.ids("carol") == []
    store.run_turn(a, QUIET, owner="alice")
    before = log_path(tmp_path, a).read_bytes()
    not_found(lambda: store.acquire(a, owner="bob"), a)
    not_found(lambda: store.acquire(a, load=False, owner="bob"), a)
    not_found(lambda: store.run_turn(a, QUIET, owner="bob"), a)
    not_found(lambda: store.run_turn(a, QUIET, owner="bob", idempotency_key="k"), a)
    not_found(lambda: store.delete(a, owner="bob"), a)
    not_found(lambda: store.acquire(anon, owner="alice"), anon)  # an unowned session is no owner's
    not_found(lambda: store.acquire(GHOST, owner="bob"), GHOST)
    assert log_path(tmp_path, a).read_bytes() == before  # bob's turn and delete touched nothing
    assert describe(store, a, owner="alice")["turns"] == 1 and describe(store, a)["turns"] == 1  # None: no control

    # a legacy log (written before owners existed) loads as owner None
    legacy = store.create({}).id
    store.run_turn(legacy, QUIET)
    lines = log_path(tmp_path, legacy).read_text().splitlines()
    head = json.loads(lines[0])
    del head["owner"]
    log_path(tmp_path, legacy).write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")

    # a restart: the owner index comes from the logs' first lines, never from reading / replaying whole logs
    def no_full_read(self):
        raise AssertionError("a whole log was read")

    monkeypatch.setattr(SessionLog, "read", no_full_read)
    again = make_store(engine, tmp_path)
    assert again.ids("alice") == [a] and again.ids("bob") == [b] and again.ids() == sorted([a, b, anon, legacy])
    assert again.ids(None) == again.ids()
    monkeypatch.undo()
    not_found(lambda: again.acquire(a, owner="bob"), a)
    not_found(lambda: again.acquire(legacy, owner="alice"), legacy)
    rec = again.acquire(legacy)
    assert rec.owner is None and rec.turns == 1
    again.release(rec)
    assert again.acquire(a, owner="alice").owner == "alice"
    again.release(again._records[a])
    again.delete(b, owner="bob")
    assert again.ids("bob") == [] and not log_path(tmp_path, b).exists() and again.ids() == sorted([a, anon, legacy])
    not_found(lambda: again.acquire(b), b)


# -- exactly-once turns ---------------------------------------------------------------------------------------------
def test_a_retry_with_the_same_key_returns_the_stored_answer(engine, tmp_path):
    store = make_store(engine, tmp_path)
    sid = store.create({}).id
    first = store.run_turn(sid, FIRST, idempotency_key="k1")
    again = store.run_turn(sid, json.loads(json.dumps(FIRST, sort_keys=True)), idempotency_key="k1")  # key order
    assert again == first and json.dumps(again) == json.dumps(first)
    assert len(turn_records(tmp_path, sid)) == 1 and describe(store, sid)["turns"] == 1
    with pytest.raises(IdempotencyConflict, match="k1"):
        store.run_turn(sid, {**FIRST, "max_tokens": 6}, idempotency_key="k1")
    assert isinstance(IdempotencyConflict(sid, "k"), ValueError)
    second = store.run_turn(sid, SECOND, idempotency_key="k2")
    assert second["turn"] == 1 and store.run_turn(sid, FIRST, idempotency_key="k1") == first  # older keys too
    # without a key, a retry is a new turn (as before)
    store.run_turn(sid, QUIET)
    store.run_turn(sid, QUIET)
    assert len(turn_records(tmp_path, sid)) == 4
    state = describe(store, sid)

    # a restart: the keys (and their answers) come back from the log
    fresh = make_store(engine, tmp_path)
    assert json.dumps(fresh.run_turn(sid, FIRST, idempotency_key="k1")) == json.dumps(first)
    assert json.dumps(fresh.run_turn(sid, SECOND, idempotency_key="k2")) == json.dumps(second)
    with pytest.raises(IdempotencyConflict):
        fresh.run_turn(sid, SECOND, idempotency_key="k1")
    assert describe(fresh, sid) == state and len(turn_records(tmp_path, sid)) == 4
    for bad in ("", 7, "x" * 300):
        with pytest.raises(ValueError, match="idempotency key"):
            fresh.run_turn(sid, QUIET, idempotency_key=bad)


def test_keys_survive_unloading_to_a_disk_tier_and_a_restart_from_it(engine, tmp_path):
    from kvsteward.serve.engine.tiers import DiskTier, SessionTiers

    def tiered(adopt=()):
        store = make_store(engine, tmp_path)
        store.max_bytes = 1  # every idle session unloads to the tier
        store.tiers = SessionTiers([DiskTier(tmp_path / "tiers")], [None], store.metrics)
        for sid in adopt:  # as `make_tiers` adopts the blobs of an earlier run
            store.tiers.adopt(sid, 0, (tmp_path / "tiers" / f"{sid}.kvstate").stat().st_size)
        return store

    store = tiered()
    sid = store.create({}).id
    first = store.run_turn(sid, FIRST, idempotency_key="k1")
    assert store._records[sid].session is None and store.tiers.where(sid) == "disk"
    assert store.run_turn(sid, FIRST, idempotency_key="k1") == first  # came back from the tier, in memory
    again = tiered(adopt=[sid])
    assert again.run_turn(sid, FIRST, idempotency_key="k1") == first  # first load in a process: from the tier
    assert again.metrics.tier_restores.labels("disk")._value.get() == 1  # (not rebuilt from the log)
    assert len(turn_records(tmp_path, sid)) == 1 and describe(again, sid)["turns"] == 1


def test_a_kill_right_after_the_fsync_then_a_retry_gives_one_answer(engine, tmp_path, monkeypatch):
    # what the answer must be: the same turns on an uninterrupted store
    ref = make_store(engine, tmp_path / "ref")
    rsid = ref.create({}).id
    ref.run_turn(rsid, FIRST)
    want = ref.run_turn(rsid, SECOND, idempotency_key="t1")

    store = make_store(engine, tmp_path / "a")
    sid = store.create({}).id
    store.run_turn(sid, FIRST)
    real_append = SessionLog.append

    def append_then_die(self, record):  # the turn is fsynced, then the process dies before it answers
        real_append(self, record)
        if record["type"] == "turn":
            raise SystemExit("killed")

    monkeypatch.setattr(SessionLog, "append", append_then_die)
    with pytest.raises(SystemExit):
        store.run_turn(sid, SECOND, idempotency_key="t1")
    monkeypatch.undo()
    assert len(turn_records(tmp_path / "a", sid)) == 2  # persisted, never acknowledged

    for retry_store in (make_store(engine, tmp_path / "a"), store):  # after a restart, and in the same process
        got = retry_store.run_turn(sid, SECOND, idempotency_key="t1")
        assert {**got, "id": rsid} == want and got["turn"] == 1
        state = describe(retry_store, sid)
        assert state["turns"] == 2 and len(turn_records(tmp_path / "a", sid)) == 2
        assert [m["content"] for m in state["messages"]].count(SECOND["messages"][0]["content"]) == 1
        assert state["history_key"] == want["history_key"] == describe(ref, rsid)["history_key"]
    nxt = store.run_turn(sid, QUIET, idempotency_key="t2")
    assert nxt["turn"] == 2 and {**nxt, "id": rsid} == ref.run_turn(rsid, QUIET)


def test_a_kill_before_the_fsync_then_a_retry_runs_the_turn_once(engine, tmp_path, monkeypatch):
    from kvsteward.serve.server import store as store_mod

    store = make_store(engine, tmp_path)
    sid = store.create({}).id

    def die(self):
        raise SystemExit("killed while decoding")

    monkeypatch.setattr(store_mod.TimedDecoder, "run", die)
    with pytest.raises(SystemExit):
        store.run_turn(sid, FIRST, idempotency_key="k")
    monkeypatch.undo()
    assert turn_records(tmp_path, sid) == []  # nothing persisted
    got = make_store(engine, tmp_path).run_turn(sid, FIRST, idempotency_key="k")
    assert got["turn"] == 0 and got["reply"] is not None
    assert store.run_turn(sid, FIRST, idempotency_key="k") == got and len(turn_records(tmp_path, sid)) == 1


# -- torn, empty and corrupt logs -----------------------------------------------------------------------------------
def test_a_torn_tail_is_cut_off_and_kept_next_to_the_log(engine, tmp_path):
    store = make_store(engine, tmp_path)
    sid = store.create({}).id
    key = store.run_turn(sid, FIRST)["history_key"]
    log = log_path(tmp_path, sid)
    good = log.read_bytes()
    tail = b'{"type":"turn","turn":1,"messages":[{"ro'
    log.write_bytes(good + tail)
    fresh = make_store(engine, tmp_path)
    assert fresh.ids() == [sid]
    state = describe(fresh, sid)
    assert state["turns"] == 1 and state["history_key"] == key
    assert log.read_bytes() == good and SessionLog(log).torn_path.read_bytes() == tail + b"\n"
    assert fresh.run_turn(sid, QUIET)["turn"] == 1
    fresh.delete(sid)
    assert not log.exists() and not SessionLog(log).torn_path.exists()


@pytest.mark.parametrize("content, match", [
    (b"", "log is empty"),
    (b'{"type":"create","v":1,"id":"x","crea', "log is empty"),  # a torn create line: cut off, then empty
    (b'{"type":"turn","turn":0,"messages":[],"cache":{},"ops":[],"reply":null}\n', "create record"),
    (b"[1,2]\n" + b'{"type":"turn"}\n', "not a valid record"),  # an unreadable line with records after it
])
def test_a_log_that_cannot_load_is_listed_refused_and_deletable(engine, tmp_path, content, match):
    sid = "sess_" + "ab" * 12
    (tmp_path / "sessions").mkdir(parents=True)
    log = log_path(tmp_path, sid)
    log.write_bytes(content)
    store = make_store(engine, tmp_path)
    assert store.ids() == [sid]
    for fn in (lambda: store.acquire(sid), lambda: store.run_turn(sid, QUIET),
               lambda: store.run_turn(sid, QUIET, idempotency_key="k")):
        with pytest.raises(CorruptSession, match=match) as e:
            fn()
        assert sid in str(e.value) and isinstance(e.value, RebuildError)
    if match == "not a valid record":
        assert log.read_bytes() == content  # corrupt, not torn: nothing cut
    not_found(lambda: store.delete(sid, owner="alice"), sid)  # unknown owner: only an unscoped caller sees it
    store.delete(sid)
    assert store.ids() == [] and not log.exists() and not SessionLog(log).torn_path.exists()
    not_found(lambda: store.acquire(sid), sid)
    not_found(lambda: store.delete(sid), sid)
    assert make_store(engine, tmp_path).ids() == []


def test_a_corrupt_line_before_the_end_does_not_cut_acknowledged_turns(engine, tmp_path):
    store = make_store(engine, tmp_path)
    sid = store.create({}, owner="alice").id
    store.run_turn(sid, QUIET)
    store.run_turn(sid, QUIET)
    log = log_path(tmp_path, sid)
    lines = log.read_bytes().splitlines(keepends=True)
    broken = lines[0] + lines[1][:-5] + b"\n" + lines[2]
    log.write_bytes(broken)
    fresh = make_store(engine, tmp_path)
    assert fresh.ids("alice") == [sid]  # the create line is intact: its owner is known
    with pytest.raises(CorruptSession, match="line 2"):
        fresh.acquire(sid, owner="alice")
    assert log.read_bytes() == broken  # the acknowledged turn after the bad line is not truncated away
    not_found(lambda: fresh.delete(sid, owner="bob"), sid)
    fresh.delete(sid, owner="alice")
    assert not log.exists() and fresh.ids() == []


def test_a_session_of_another_model_can_be_deleted(engine, tmp_path):
    from kvsteward.models import tiny_model
    from kvsteward.serve.engine import Engine

    sid = make_store(engine, tmp_path).create({}).id
    other = make_store(Engine(tiny_model("llama", seed=5, vocab=len(engine.tokenizer)), engine.tokenizer), tmp_path)
    with pytest.raises(RebuildError, match="was created with model"):
        other.acquire(sid)
    other.delete(sid)
    assert other.ids() == [] and not log_path(tmp_path, sid).exists()
