"""Policies (scorers + shared selection), budget bounds, bounded positions."""

from __future__ import annotations

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.blueprint import BlueprintError, foresight_bonus, parse_blueprint
from kvsteward.serve.engine.policies import SlotView, get_policy, select_keep
from kvsteward.serve.engine.session import CacheOpError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama", seed=1, layers=1, max_positions=1 << 17))


def view(n: int, **kw) -> SlotView:
    base = dict(logical=torch.arange(n), position=torch.arange(n), step=torch.zeros(n, dtype=torch.long),
                is_tool=torch.zeros(n, dtype=torch.bool), cumulative=torch.zeros(n), window=torch.zeros(n),
                current_step=0, n_logical=n)
    base.update(kw)
    return SlotView(**base)


def test_foresight_bonus_hand_worked():
    spans = parse_blueprint('[{"span": [0, 2], "readers": [5, 9]}, {"span": [4, 6], "readers": [3]}]')
    logical = torch.arange(8)
    # step 3: span A next reader 5 → τ/3; span B reader 3 → τ/1 (soonest ranks highest)
    b = foresight_bonus(spans, logical, step=3)
    assert b.tolist() == pytest.approx([1e5 / 3, 1e5 / 3, 0, 0, 1e5, 1e5, 0, 0])
    # step 6: span B past its last reader → 0; span A next reader 9 → τ/4
    b = foresight_bonus(spans, logical, step=6)
    assert b.tolist() == pytest.approx([1e5 / 4, 1e5 / 4, 0, 0, 0, 0, 0, 0])
    assert foresight_bonus(spans, logical, step=10).sum() == 0


@pytest.mark.parametrize("bad, msg", [
    ("{", "not valid JSON"), ('{"span": [0, 1]}', "must be a list"), ('[{"span": [3, 1], "readers": []}]', "empty"),
    ('[{"span": [0], "readers": []}]', "span must be"), ('[{"span": [0, 2], "readers": [-1]}]', "readers"),
    ('[{"span": [0, 2], "readers": [1], "x": 1}]', "keys"),
])
def test_malformed_blueprint_named(bad, msg):
    with pytest.raises(BlueprintError, match=msg):
        parse_blueprint(bad)


def test_select_keep_topb_with_protection():
    p = get_policy("h2o", sinks=2, recent=3)
    v = view(20, cumulative=torch.tensor([0.0] * 10 + [5.0, 1.0, 4.0, 2.0, 3.0] + [0.0] * 5))
    keep = select_keep(p.score(v), v, p, budget=8)
    # sinks 0,1 + recent 17,18,19 + top-3 scores among the rest: 10 (5), 12 (4), 14 (3)
    assert keep.tolist() == [0, 1, 10, 12, 14, 17, 18, 19]


def test_foresight_planned_outrank_unplanned():
    p = get_policy("foresight", sinks=0, recent=0)
    cum = torch.rand(30) * 10
    cum[5:8] = 0.0  # a planned span nobody attended to yet
    v = view(30, cumulative=cum, blueprint=parse_blueprint([{"span": [5, 8], "readers": [4]}]), current_step=2)
    keep = select_keep(p.score(v), v, p, budget=5)
    assert {5, 6, 7} <= set(keep.tolist())
    h2o = get_policy("h2o", sinks=0, recent=0)
    assert not {5, 6, 7} & set(select_keep(h2o.score(v), v, h2o, budget=5).tolist())


def test_foresight_recent_keeps_plan_then_one_recent_window():
    """foresight-recent: planned spans first, then the newest tokens as one contiguous run, whatever attention said
    (the heavy hitters that foresight keeps scattered through the session are ignored)."""
    p = get_policy("foresight-recent", sinks=2, recent=0)
    cum = torch.zeros(40)
    cum[12] = cum[20] = 100.0  # heavy hitters: foresight keeps them, foresight-recent must not
    v = view(40, cumulative=cum, blueprint=parse_blueprint([{"span": [5, 9], "readers": [4]}]), current_step=2)
    assert select_keep(p.score(v), v, p, budget=12).tolist() == [0, 1, 5, 6, 7, 8, 34, 35, 36, 37, 38, 39]
    h2o_like = get_policy("foresight", sinks=2, recent=0)
    assert {12, 20} <= set(select_keep(h2o_like.score(v), v, h2o_like, budget=12).tolist())
    # past the plan's last reader the span is ordinary text: the window takes its room
    v = view(40, blueprint=parse_blueprint([{"span": [5, 9], "readers": [4]}]), current_step=5)
    assert select_keep(p.score(v), v, p, budget=12).tolist() == [0, 1, *range(30, 40)]
    # recency stays below any live bonus, even when the reader is thousands of steps away and the session is long
    far = view(10_000, blueprint=parse_blueprint([{"span": [5, 9], "readers": [5_000]}]), current_step=0)
    assert set(range(5, 9)) <= set(select_keep(p.score(far), far, p, budget=12).tolist())


def test_streaming_keeps_sinks_and_recent():
    p = get_policy("streaming", sinks=4)
    v = view(100)
    assert select_keep(p.score(v), v, p, budget=10).tolist() == [0, 1, 2, 3, 94, 95, 96, 97, 98, 99]


def test_snapkv_pools_votes_to_neighbours():
    p = get_policy("snapkv", sinks=0, recent=0, pool_kernel=3)
    w = torch.zeros(20)
    w[10] = 1.0
    v = view(20, window=w)
    assert select_keep(p.score(v), v, p, budget=3).tolist() == [9, 10, 11]


def test_akv_rolling_drops_old_tool_responses_even_under_budget(engine):
    s = engine.session("akv-rolling", budget=10_000, chunk=64, keep_tool_responses=2)
    for i in range(5):
        s.append([1, 2, 3], kind="user")
        s.append([4 + i] * 5, kind="tool")
    steps = s.table.field("step").tolist()
    tool_steps_left = sorted({st for st, tool in zip(steps, s.table.field("is_tool").tolist(), strict=True) if tool})
    assert tool_steps_left == [7, 9]  # only the last two tool responses remain
    assert s.resident == 5 * 3 + 2 * 5


def test_budget_bound_over_50k_tokens(engine):
    """Resident slots never exceed B + H; allocated KV bytes stop growing with session length."""
    B, H = 512, 256
    s = engine.session("h2o", budget=B, chunk=H)
    gen = torch.Generator().manual_seed(0)
    peak, bytes_at = 0, {}
    for _ in range(50_000 // 1000):
        s.append(torch.randint(0, 256, (1000,), generator=gen).tolist())
        peak = max(peak, s.peak_resident)
        bytes_at[s.n_logical] = s.table.allocated_bytes()
        assert s.resident <= B
    assert s.n_logical == 50_000
    assert peak <= B + H
    assert bytes_at[10_000] == bytes_at[50_000]
    s.generate(40)
    assert s.resident <= B and s.peak_resident <= B + H


def test_bounded_positions_never_reach_limit_and_match_reference(engine):
    """pace on a session 8× longer than L: every physical position < L; after the renumbers, the engine's next-token
    logits equal the reference replay of the same (drop + reposition) op history."""
    from kvsteward.serve.engine.reference import ReferenceSession

    B, H, L = 64, 32, 128
    s = engine.session("pace", budget=B, chunk=H, limit=L, blueprint=[{"span": [0, 10], "readers": [30]}], recent=16)
    gen = torch.Generator().manual_seed(1)
    for _ in range(32):
        s.append(torch.randint(0, 256, (32,), generator=gen).tolist())
        assert int(s.resident_positions().max()) < L and s.next_pos <= L
    assert s.renumbers > 5
    assert set(range(10)) <= set(s.resident_logical().tolist())  # the planned span survived
    got = s.append([7, 8, 9], logits="all")
    ref = ReferenceSession(engine.model, engine.rope.inv_freq)
    want = ref.replay(s.history)  # eviction ≡ drop, renumber ≡ reposition, in the order they happened
    assert ref.logical == s.resident_logical().tolist() and ref.positions == s.resident_positions().tolist()
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_set_budget_compresses_once_or_changes_b(engine):
    """`set_budget(None)`: nothing more is evicted (kvpress's compress-once protocol); a new B applies from the next
    eviction; a bad B, or no budget with bounded positions, is refused and changes nothing."""
    gen = torch.Generator().manual_seed(4)
    s = engine.session("h2o", budget=8, chunk=4, sinks=1, recent=2)
    s.append(torch.randint(0, 256, (20,), generator=gen).tolist())
    assert s.resident == 8
    s.set_budget(None)
    s.append(torch.randint(0, 256, (10,), generator=gen).tolist())
    s.generate(3)
    assert s.resident == 21
    s.set_budget(5)
    s.append([7])
    assert s.resident == 5
    with pytest.raises(CacheOpError, match="budget must be >= 1"):
        s.set_budget(0)
    bounded = engine.session("h2o", budget=8, chunk=4, limit=32)
    with pytest.raises(CacheOpError, match="bounded positions need a budget"):
        bounded.set_budget(None)
    with pytest.raises(CacheOpError, match="must exceed"):
        bounded.set_budget(30)
    assert s.config.budget == 5 and bounded.config.budget == 8
