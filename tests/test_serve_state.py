"""The (config, ops) prefix cache: reuse only up to the first differing token or op, isolation between requests,
bitwise equality with a fresh build, LRU eviction by bytes that never touches a pinned state."""

from __future__ import annotations

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.ops import SessionSpec, build_ops, message_ranges, parse_cache
from kvsteward.serve.server.completions import ChatService, ServeLimits
from kvsteward.serve.server.metrics import Metrics
from kvsteward.serve.server.state import PrefixCache, compact_copy, replay_positions, unreposition

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama", seed=7))


MSGS = {name: torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        for i, (name, n) in enumerate([("A", 9), ("B", 7), ("C", 5), ("C2", 5), ("D", 6),
                                                             ("E", 20)])}


def request(names: list[str], cache: dict | None = None):
    pieces = [MSGS[n] for n in names]
    return build_ops(pieces, ["user"] * len(pieces), parse_cache(cache, len(pieces))), message_ranges(pieces)


def service(engine, cache_bytes: int = 1 << 30, spec: SessionSpec | None = None) -> ChatService:
    return ChatService(engine, spec or SessionSpec(chunk=4), cache_bytes, ServeLimits(), Metrics())


REQUESTS = {
    "r1": (["A", "B", "C"], None),
    "r2": (["A", "B", "C"], {"drop": {"1": [0]}}),
    "r3": (["A", "B", "C", "D"], {"reposition": [2]}),
    "r4": (["A", "B", "C2"], None),
    "r5": (["A", "B", "C"], {"drop": {"2": [1]}, "reposition": [2]}),
}


def build(svc: ChatService, name: str, spec: SessionSpec):
    ops, ranges = request(*REQUESTS[name])
    return svc._build(spec, ops, ranges)


@pytest.mark.parametrize("spec", [SessionSpec(chunk=4), SessionSpec("h2o", budget=12, chunk=4)],
                         ids=["full", "h2o"])
def test_interleaved_requests_equal_fresh_builds(engine, spec):
    alone = {}
    for name in REQUESTS:
        s, depth = build(service(engine, spec=spec), name, spec)
        assert depth == 0
        alone[name] = s
    shared = service(engine, spec=spec)
    order = ["r1", "r2", "r3", "r4", "r5", "r1", "r2", "r3"]
    reused = []
    for name in order:
        s, depth = build(shared, name, spec)
        reused.append(depth)
        assert s.history == alone[name].history
        assert torch.equal(s.last_logits, alone[name].last_logits)  # bitwise: same forwards in the same order
        assert s.resident_logical().tolist() == alone[name].resident_logical().tolist()
        assert s.resident_positions().tolist() == alone[name].resident_positions().tolist()
    # r2 branches at its drop (after A, B: the checkpoint before r1's last message); r3 and r5 extend r1; r4
    # differs in the last message; repeats are full hits (r1: 3 ops, r2: 4, r3: 5)
    assert reused == [0, 2, 3, 2, 3, 3, 4, 5]


def test_a_drop_in_one_request_never_changes_another(engine):
    spec = SessionSpec(chunk=4)
    svc = service(engine)
    first, _ = build(svc, "r1", spec)
    build(svc, "r2", spec)  # drops message 0 on a fork of the shared A-B prefix
    again, depth = build(svc, "r1", spec)
    assert depth == 3 and torch.equal(again.last_logits, first.last_logits)
    assert again.resident == first.resident == sum(len(MSGS[n]) for n in "ABC")
    again.drop([0, 1])  # mutating the fork handed out leaves the cached state intact
    third, _ = build(svc, "r1", spec)
    assert third.resident == first.resident and torch.equal(third.last_logits, first.last_logits)


def test_config_is_part_of_the_key(engine):
    svc = service(engine)
    build(svc, "r1", SessionSpec(chunk=4))
    _, depth = build(svc, "r1", SessionSpec("h2o", budget=12, chunk=4))
    assert depth == 0


def test_history_is_identity_ops_orders_do_not_share(engine):
    """AKV Figure 5: A B C then drop A, versus A B, drop A, then C — same survivors, different states."""
    spec = SessionSpec(chunk=4)
    svc = service(engine)
    late, _ = svc._build(spec, *request(["A", "B", "C"], {"drop": {"2": [0]}}))
    early, depth = svc._build(spec, *request(["A", "B", "C"], {"drop": {"1": [0]}}))
    assert depth == 2  # shares only A, B
    assert late.resident_logical().tolist() == early.resident_logical().tolist()
    assert late.history_key() != early.history_key()
    assert not torch.allclose(late.last_logits, early.last_logits)


def test_lru_eviction_by_bytes_keeps_pinned_and_inner_nodes(engine):
    spec = SessionSpec(chunk=4)
    states, size = {}, {}
    for name in ["r1", "r4", "r3"]:
        ops, ranges = request(*REQUESTS[name])
        s, _ = build(service(engine), name, spec)
        states[name] = (ops, s)
        size[name] = compact_copy(s).table.allocated_bytes()
    metrics = Metrics()
    cache = PrefixCache(max_bytes=size["r1"] + size["r3"] + 1, metrics=metrics)  # all three do not fit
    ops1, s1 = states["r1"]
    cache.insert(spec, ops1, s1)
    cache.insert(spec, *states["r4"])
    assert cache.states == 2 and cache.evictions == 0
    # pin r1 as a running lookup would, then overflow: r4 (unpinned, least recently used after r1's pin) goes
    node = cache._path(spec, ops1, create=False)
    node.pins += 1
    cache.insert(spec, *states["r3"])
    assert cache.bytes <= cache.max_bytes
    assert cache._path(spec, ops1, create=False).state is not None
    assert cache._path(spec, states["r4"][0], create=False) is None  # evicted and its empty leaf pruned
    assert cache.evictions == 1 and metrics.evictions._value.get() == 1
    node.pins -= 1
    # r1's node holds a state and sits inside r3's path: evicting r1 keeps the node so r3 stays findable
    cache._drop_state(cache._path(spec, ops1, create=False))
    forked, depth = cache.lookup_fork(spec, states["r3"][0])
    assert depth == len(states["r3"][0]) and torch.equal(forked.last_logits, states["r3"][1].last_logits)


def test_state_larger_than_the_budget_is_not_stored(engine):
    spec = SessionSpec(chunk=4)
    ops, _ = request(*REQUESTS["r1"])
    s, _ = build(service(engine), "r1", spec)
    cache = PrefixCache(max_bytes=100)
    assert cache.insert(spec, ops, s) is False
    assert cache.states == 0 and cache.lookup_fork(spec, ops) == (None, 0)


def test_compact_copy_is_exact_and_tight(engine):
    s, _ = build(service(engine), "r5", SessionSpec(chunk=4))
    c = compact_copy(s)
    assert c.table.capacity == c.resident == s.resident
    assert c.table.allocated_bytes() < s.table.allocated_bytes()
    nxt = MSGS["D"]
    assert torch.equal(c.append(nxt), s.fork().append(nxt))


def test_state_superseded_by_a_drop_is_evicted_before_an_older_finished_one(engine):
    spec = SessionSpec(chunk=4)
    svc = service(engine)
    ops1, _ = request(*REQUESTS["r1"])
    s1, _ = build(svc, "r1", spec)
    ops2, ranges2 = request(*REQUESTS["r2"])  # A, B, drop(0), C
    s2, _ = build(svc, "r2", spec)
    cut = ops2.index(("drop", (0,)))
    s0, _ = svc._build(spec, ops2[:cut], ranges2)  # the state before the drop: A, B
    size = {k: compact_copy(s).table.allocated_bytes() for k, s in {"r1": s1, "r2": s2, "r0": s0}.items()}
    cache = PrefixCache(max_bytes=sum(size.values()) - 1)  # one of the three must go
    cache.insert(spec, ops1, s1)  # oldest: plain LRU would evict this finished request
    cache.insert(spec, ops2[:cut], s0)
    cache.insert(spec, ops2, s2)
    assert cache.evictions == 1
    assert cache._path(spec, ops1, create=False).state is not None
    assert cache._path(spec, ops2[:cut], create=False).state is None  # superseded through the drop: freed first
    forked, depth = cache.lookup_fork(spec, ops2)
    assert depth == len(ops2) and torch.equal(forked.last_logits, s2.last_logits)


# -- compatible matches: a repositioned version of the request's prefix (AKV §4.2.3, A.1.2) ---------------------------
SPECS = {
    "full": SessionSpec(chunk=4),
    "h2o": SessionSpec("h2o", budget=12, chunk=4),
    "bounded": SessionSpec("positions-only", budget=12, chunk=4, limit=20),
}
# (messages, cache) of the state the cache holds = P + trailing repositions, and of the request = P + more
COMPATIBLE = {
    # P = A B C, drop B; held: P + reposition; request: P + D (no reposition)
    "plain": ((["A", "B", "C"], {"drop": {"2": [1]}, "reposition": [2]}), (["A", "B", "C", "D"], {"drop": {"2": [1]}})),
    # P itself moved keys before (drop A + reposition after B), so the reference keys stay; held: P + reposition;
    # request: P + E (long enough for bounded positions to renumber)
    "moved": ((["A", "B", "C"], {"drop": {"1": [0], "2": [1]}, "reposition": [1, 2]}),
              (["A", "B", "C", "E"], {"drop": {"1": [0], "2": [1]}, "reposition": [1]})),
}


def held_only(engine, spec, names, cache):
    """A service whose prefix cache holds exactly one state: that of (names, cache)."""
    svc = service(engine, spec=spec)
    svc.checkpoints = False
    svc._build(spec, *request(names, cache))
    assert svc.cache.states == 1
    return svc


def assert_same_state(got, want):
    """Same identity, positions, metadata; keys and next-token logits within 1e-5 and, on CPU fp32, bit for bit (a
    rotation by 0 from the fp32 reference keys returns them, and P's own moves are recomputed from the same K_ref)."""
    assert got.history == want.history and got.history_key() == want.history_key()
    assert got.next_pos == want.next_pos and got.renumbers == want.renumbers
    assert got.resident_logical().tolist() == want.resident_logical().tolist()
    assert got.resident_positions().tolist() == want.resident_positions().tolist()
    assert (got.table.ref_k is None) == (want.table.ref_k is None)
    n = want.resident
    for name in ("ref_pos", "cumulative", "window", "step", "token"):
        assert torch.equal(got.table.field(name), want.table.field(name)), name
    for layer in range(want.table.n_layers):
        k_got, k_want = got.table.k[layer][:, :n], want.table.k[layer][:, :n]
        assert torch.allclose(k_got, k_want, atol=1e-5, rtol=0), layer
        assert torch.equal(k_got, k_want), layer
        assert torch.equal(got.table.v[layer][:, :n], want.table.v[layer][:, :n])
    assert torch.allclose(got.last_logits, want.last_logits, atol=1e-5, rtol=0)
    assert torch.equal(got.last_logits, want.last_logits)


@pytest.mark.parametrize("case", list(COMPATIBLE))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_compatible_match_equals_a_fresh_build_of_the_prefix(engine, spec_name, case):
    """Held: only state(P + reposition). Request P + D: served by un-repositioning the held state (re-rotated keys,
    next position, history), equal to a fresh build — for full, h2o (evictions) and bounded positions (renumbers)."""
    spec = SPECS[spec_name]
    held, req = COMPATIBLE[case]
    svc = held_only(engine, spec, *held)
    ops, ranges = request(*req)
    held_ops, _ = request(*held)
    p = len(held_ops) - 1  # P = the held path without its trailing reposition
    assert ops[:p] == held_ops[:p] and held_ops[p] == ("reposition",) and ops[p] != ("reposition",)
    fresh_p, _ = service(engine, spec=spec)._build(spec, ops[:p], ranges)
    assert fresh_p.resident_positions().tolist() != list(range(fresh_p.resident))  # the keys really move back

    # the lookup alone: the restored fork is state(P)
    match = svc.cache.lookup(spec, ops)
    assert (match.kind, match.depth, match.repositions) == ("compatible", p, 1)
    assert_same_state(match.session, fresh_p)
    assert svc.cache.compatible_hits == 1

    # the whole request: reuse P, append D; next-token logits and identity equal a fresh build of P + D
    got, m = svc._build_match(spec, ops, ranges)
    assert (m.kind, m.depth) == ("compatible", p)
    fresh, depth = service(engine, spec=spec)._build(spec, ops, ranges)
    assert depth == 0
    if spec_name != "full":  # the configs really evict (h2o) and renumber (bounded: its decision reads next_pos)
        assert any(e["op"] == {"h2o": "evict", "bounded": "renumber"}[spec_name] for e in fresh.history)
    assert_same_state(got, fresh)
    # the held state was handed out as a copy: still the repositioned one
    again = svc.cache.lookup(spec, held_ops)
    assert again.kind == "exact" and again.session.resident_positions().tolist() == list(range(again.session.resident))


def test_exact_state_is_preferred_on_ties_and_a_deeper_compatible_one_wins(engine):
    spec = SPECS["full"]
    held, req = COMPATIBLE["plain"]
    svc = held_only(engine, spec, *held)
    ops, ranges = request(*req)
    p = len(request(*held)[0]) - 1  # A B C drop(1)
    svc._build(spec, ops[:2], ranges)  # exact A B (depth 2) < compatible P (depth 4)
    match = svc.cache.lookup(spec, ops)
    assert (match.kind, match.depth) == ("compatible", p)
    exact_p, m = svc._build_match(spec, ops[:p], ranges)  # restores state(P) and stores it: exact from now on
    assert (m.kind, m.depth) == ("compatible", p)
    match = svc.cache.lookup(spec, ops)
    assert (match.kind, match.depth, match.repositions) == ("exact", p, 0)
    assert match.session.history == exact_p.history and torch.equal(match.session.last_logits, exact_p.last_logits)
    assert svc.cache.compatible_hits == 2
    assert svc.cache.lookup(spec, ops, compatible=False).depth == p


def test_a_reposition_before_a_later_op_is_never_matched_compatibly(engine):
    """AKV Figure 11: in A B drop(A) reposition C, the reposition changed C's hidden states, so that state is no
    position version of A B drop(A) C: a request continuing the latter gets nothing from it; only trailing
    repositions are undone."""
    spec = SPECS["full"]
    dropped = {"drop": {"1": [0]}}
    svc = held_only(engine, spec, ["A", "B", "C"], {**dropped, "reposition": [1, 2]})  # A B drop repos C repos
    match = svc.cache.lookup(spec, request(["A", "B", "C", "D"], dropped)[0])
    assert (match.session, match.depth, match.kind) == (None, 0, "miss")
    # the same held state is a valid position version of A B drop repos C: only its trailing reposition is undone
    ops, ranges = request(["A", "B", "C", "D"], {**dropped, "reposition": [1]})
    match = svc.cache.lookup(spec, ops)
    assert (match.kind, match.depth, match.repositions) == ("compatible", 5, 1)
    fresh, _ = service(engine, spec=spec)._build(spec, ops[:5], ranges)
    assert_same_state(match.session, fresh)


def test_unreposition_refuses_a_history_without_trailing_repositions(engine):
    s, _ = service(engine)._build(SPECS["full"], *request(["A", "B"], {"reposition": [0]}))
    before = (list(s.history), s.resident_positions().tolist(), s.next_pos)
    with pytest.raises(ValueError):
        unreposition(s, 1)
    assert (s.history, s.resident_positions().tolist(), s.next_pos) == before


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_replayed_positions_equal_the_engine_positions(engine, spec_name):
    spec = SPECS[spec_name]
    for names, cache in [(["A", "B", "C", "D"], {"drop": {"1": [0], "3": [2]}, "reposition": [1, 2]}),
                         (["A", "B", "C", "D"], None)]:
        s, _ = service(engine, spec=spec)._build(spec, *request(names, cache))
        pos, next_pos = replay_positions(s.history)
        assert pos == dict(zip(s.resident_logical().tolist(), s.resident_positions().tolist(), strict=True))
        assert next_pos == s.next_pos
