"""The AKV operate-after grammar: parsing, validation errors, op order, and the engine state it produces compared
with a hand-built op sequence and with the independent reference replay (transformers' own cache)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.ops import (
    CacheSpec,
    OpsError,
    SessionSpec,
    apply_op,
    build_ops,
    message_pieces,
    message_ranges,
    normalize_messages,
    parse_cache,
    resolve_blueprint,
    session_spec,
)
from kvsteward.serve.engine.reference import ReferenceSession

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama", seed=4))


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- parsing --------------------------------------------------------------------------------------------------------
def test_parse_cache_accepts_string_keys_and_sorts():
    spec = parse_cache({"drop": {"3": [2, 0], "1": [1]}, "reposition": [3, 1]}, n_messages=5)
    assert spec.drop == {1: (1,), 3: (0, 2)}
    assert spec.reposition == frozenset({1, 3})
    assert spec.as_json() == {"drop": {"1": [1], "3": [0, 2]}, "reposition": [1, 3]}


@pytest.mark.parametrize("cache, match", [
    ({"drop": {"7": [0]}}, r"boundary after message 7 is out of range: there are 4 messages"),
    ({"drop": {"1": [2]}}, r"message 2 is not yet appended at the boundary after message 1"),
    ({"drop": {"2": [9]}}, r"message 9 is unknown"),
    ({"drop": {"1": [0], "2": [0]}}, r"message 0 is already dropped"),
    ({"drop": {"1": [0, 0]}}, r"message 0 is already dropped"),
    ({"drop": {"x": [0]}}, r"is not a message index"),
    ({"drop": {"1": []}}, r"non-empty list"),
    ({"drop": [1, 2]}, r"cache.drop must map"),
    ({"reposition": [4]}, r"cache.reposition: boundary after message 4 is out of range"),
    ({"reposition": [-1]}, r"out of range|already passed"),
    ({"reposition": [1, 1]}, r"lists a boundary twice"),
    ({"reposition": 2}, r"must be a list"),
    ({"evict": {}}, r"unknown field"),
    ([1], r"cache must be an object"),
])
def test_parse_cache_errors_name_the_problem(cache, match):
    with pytest.raises(OpsError, match=match):
        parse_cache(cache, n_messages=4)


def test_session_boundaries_cannot_reach_into_the_past():
    # a session with 5 messages appends 2 more: ops may run after message 4 (now) or later, not after message 2
    assert parse_cache({"drop": {"4": [1]}}, n_messages=7, first=5).drop == {4: (1,)}
    with pytest.raises(OpsError, match="already passed"):
        parse_cache({"reposition": [2]}, n_messages=7, first=5)
    with pytest.raises(OpsError, match="already dropped"):
        parse_cache({"drop": {"5": [1]}}, n_messages=7, first=5, dropped=frozenset({1}))


def test_build_ops_drop_before_reposition_at_one_boundary():
    spec = CacheSpec(drop={1: (0,)}, reposition=frozenset({1, 2}))
    ops = build_ops([[1, 2], [3], [4, 5]], ["system", "user", "assistant"], spec)
    assert ops == [("append", "system", (1, 2)), ("append", "user", (3,)), ("drop", (0,)), ("reposition",),
                   ("append", "assistant", (4, 5)), ("reposition",)]
    # a later turn of a session: the boundary after the last old message runs first
    later = build_ops([[6]], ["user"], CacheSpec(drop={2: (1,)}), first=3)
    assert later == [("drop", (1,)), ("append", "user", (6,))]


def test_normalize_messages():
    msgs = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                          "text": "b"}]},
                               {"role": "assistant", "content": None, "name": None}])
    assert msgs == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    with pytest.raises(OpsError, match=r"messages\[0\].role 'robot'"):
        normalize_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(OpsError, match="non-empty list"):
        normalize_messages([])
    with pytest.raises(OpsError, match="text part"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_blueprint_keyed_by_message_resolves_to_its_token_span():
    ranges = message_ranges([[1, 2, 3], [4, 5], [6]])
    assert ranges == [(0, 3), (3, 5), (5, 6)]
    spans = resolve_blueprint([{"message": 1, "readers": [4, 2]}, {"span": [0, 2], "readers": [3]}], ranges)
    assert [(s.start, s.end, s.readers) for s in spans] == [(3, 5, (2, 4)), (0, 2, (3,))]
    with pytest.raises(OpsError, match="message 5 is unknown"):
        resolve_blueprint([{"message": 5, "readers": [1]}], ranges)
    with pytest.raises(OpsError, match="keyed by message"):
        resolve_blueprint([{"message": 0, "readers": [1]}], None)
    with pytest.raises(OpsError, match=r"blueprint\[0\].span"):
        resolve_blueprint([{"span": [3, 1], "readers": [1]}], ranges)


def test_session_spec_validates_policy_and_normalises_full(engine):
    defaults = SessionSpec(policy="h2o", budget=64, chunk=16)
    assert session_spec(engine, defaults) == defaults
    assert session_spec(engine, defaults, policy="full") == SessionSpec(chunk=16)
    with pytest.raises(OpsError, match="unknown policy 'lru'"):
        session_spec(engine, defaults, policy="lru")
    with pytest.raises(OpsError, match="needs a budget"):
        session_spec(engine, defaults, policy="snapkv")
    with pytest.raises(OpsError, match="limit L=70 must exceed budget"):
        session_spec(engine, defaults, policy="pace", budget=64, limit=70)


def test_message_pieces_equal_synth_chat_and_are_incremental():
    from kvsteward.models import load_tokenizer
    from kvsteward.synth.chat import message_token_ids

    tok = load_tokenizer("smollm2")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "tool", "content": "42"}, {"role": "user", "content": "so?"}]
    assert message_pieces(tok, msgs) == message_token_ids(tok, msgs)
    assert message_pieces(tok, msgs, start=2) == message_token_ids(tok, msgs)[2:]


# -- the state the grammar produces ---------------------------------------------------------------------------------
def test_grammar_reproduces_akv_worked_example_against_reference(engine):
    """AKV A.1.1 as a request: messages A B C D E F; after C drop B and reposition; after D drop D; after E
    reposition. Positions and logits match the reference replay of the same ops on transformers' cache."""
    pieces = [toks(3, s) for s in range(6)]
    spec = parse_cache({"drop": {"2": [1], "3": [3]}, "reposition": [2, 4]}, n_messages=6)
    ops = build_ops(pieces, ["user"] * 6, spec)
    ranges = message_ranges(pieces)
    s = engine.session("full")
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    lock = threading.Lock()
    for op in ops:
        apply_op(s, op, ranges, lock)
        if op[0] == "append":
            want = ref.append(list(op[2]))
        elif op[0] == "drop":
            ref.drop([t for j in op[1] for t in range(*ranges[j])])
        else:
            ref.reposition()
    # A0-2 C3-5 survive B's drop and move to 0..5; D at 6..8 is dropped; E at 9..11 moves to 6..8; F at 9..11
    assert s.resident_positions().tolist() == list(range(12))
    assert s.resident_logical().tolist() == [0, 1, 2, 6, 7, 8, 12, 13, 14, 15, 16, 17]
    assert s.resident_logical().tolist() == ref.logical and s.resident_positions().tolist() == ref.positions
    torch.testing.assert_close(s.last_logits, want[-1], atol=2e-5, rtol=1e-4)
    assert [h["op"] for h in s.history] == ["append"] * 3 + ["drop", "reposition", "append", "drop", "append",
                                                               "reposition", "append"]
