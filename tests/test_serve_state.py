"""The (config, ops) prefix cache: reuse only up to the first differing token or op, isolation between requests,
bitwise equality with a fresh build, LRU eviction by bytes that never touches a pinned state."""

from __future__ import annotations

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.completions import ChatService, ServeLimits
from kvsteward.serve.engine import Engine
from kvsteward.serve.metrics import Metrics
from kvsteward.serve.ops import SessionSpec, build_ops, message_ranges, parse_cache
from kvsteward.serve.state import PrefixCache, compact_copy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama", seed=7))


MSGS = {name: torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        for i, (name, n) in enumerate([("A", 9), ("B", 7), ("C", 5), ("C2", 5), ("D", 6)])}


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
