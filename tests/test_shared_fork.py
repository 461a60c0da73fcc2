"""Shared forks (`Session.fork(shared=True)`, `SlotTable.share`): the aux thread's fork reads the main session's K/V
rows in place (no copy) and must behave like an independent copy, while the main session — which keeps running — is
bit for bit what it would be with no fork at all. References: a dense copy fork, the main session replayed alone,
transformers' own DynamicCache replay of the fork's history, and dense attention over the concatenated keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.attention import ForwardContext, steward_attention
from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.engine.slots import SharedPrefix

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engine(request) -> Engine:
    return Engine(tiny_model(request.param, seed=3))


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


CONFIGS = {
    "full": dict(policy="full"),
    "h2o": dict(policy="h2o", budget=40, chunk=16),
    "snapkv-bounded": dict(policy="snapkv", budget=40, chunk=16, limit=80),
    "streaming": dict(policy="streaming", budget=40, chunk=16),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shared_fork_equals_a_copy_and_main_is_untouched(engine, name):
    kw = CONFIGS[name]
    main = engine.session(**kw)
    main.append(toks(70, 1))
    alone = main.fork()  # the main session as it would run with no fork taken
    shared, copy = main.fork(shared=True), main.fork()
    assert shared.table.prefix.k[0].data_ptr() == main.table.k[0].data_ptr()  # no K/V copied
    assert shared.table.allocated_bytes() < main.table.allocated_bytes() / 2
    before = [k.clone() for k in shared.table.prefix.k]

    # the main session keeps going (appends, evictions, a drop, a reposition) while the fork is alive
    for s in (main, alone):
        s.append(toks(23, 2))
        s.drop(s.resident_logical().tolist()[3:6])
        s.reposition()
        s.generate(5)
    assert torch.equal(main.last_logits, alone.last_logits) and main.history == alone.history
    assert all(torch.equal(a, b) for a, b in zip(before, shared.table.prefix.k, strict=True))  # never written

    # the fork appends a trigger (evicting under a budget) and decodes: as a copy does
    close(shared.append(toks(9, 3), logits="all"), copy.append(toks(9, 3), logits="all"))
    assert shared.generate(12) == copy.generate(12)
    close(shared.last_logits, copy.last_logits)
    assert shared.history == copy.history
    assert shared.resident_logical().tolist() == copy.resident_logical().tolist()
    assert shared.resident_positions().tolist() == copy.resident_positions().tolist()
    ref = ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)
    close(shared.last_logits, _replay_last(ref, shared.history))


def _replay_last(ref: ReferenceSession, history: list[dict]) -> torch.Tensor:
    logits = ref.replay(history)
    return logits[-1] if logits.dim() == 2 else logits


def test_fork_evictions_only_mark_prefix_rows_dead(engine):
    main = engine.session("h2o", budget=40, chunk=16)
    main.append(toks(70, 4))
    fork = main.fork(shared=True)
    fork.append(toks(9, 5))  # 49 resident > 40: the fork evicts 9, some of them prefix rows
    t = fork.table
    assert t.prefix is not None and t.n == 40
    assert t.base == int(t.prefix.alive.sum()) < 40  # slots [0, base) are alive prefix rows, the rest its own
    assert t.prefix.k[0].data_ptr() == main.table.k[0].data_ptr() and main.resident == 40  # main unchanged


def test_renumber_in_a_fork_takes_a_dense_copy(engine):
    main = engine.session("h2o", budget=40, chunk=16, limit=80)
    main.append(toks(78, 6))  # next position near L: the fork's trigger renumbers
    fork, copy = main.fork(shared=True), main.fork()
    close(fork.append(toks(9, 7), logits="all"), copy.append(toks(9, 7), logits="all"))
    assert fork.renumbers == copy.renumbers == main.renumbers + 1
    assert fork.table.prefix is None  # it rewrote its keys, so it owns them
    assert fork.generate(6) == copy.generate(6)


def test_fork_of_a_shared_fork_shares_the_same_rows(engine):
    main = engine.session("h2o", budget=40, chunk=16)
    main.append(toks(60, 8))
    a = main.fork(shared=True)
    a.append(toks(5, 9))
    b, b_copy = a.fork(shared=True), a.fork()
    assert b.table.prefix.k[0].data_ptr() == main.table.k[0].data_ptr()
    assert b_copy.table.prefix is None  # a plain fork of a shared fork is dense
    a.generate(4)  # a moves on: b keeps its own view
    assert b.generate(6) == b_copy.generate(6)
    close(b.last_logits, b_copy.last_logits)


def test_tiered_fork_spills_prefix_rows_and_rehydrates_them(engine):
    """A shared fork evicting planned rows it reads from the parent exports them from the parent's buffers; they come
    back at their readers as in a copy fork (the three 16-token spans of messages 10-12, read at steps 20/25/30)."""
    from kvsteward.serve.engine.blueprint import parse_blueprint
    from kvsteward.serve.engine.policies import get_policy
    from kvsteward.serve.engine.session import Session, SessionConfig
    from kvsteward.serve.engine.spill import host_store

    blueprint = [{"span": [184 + 16 * i, 200 + 16 * i], "readers": [r]} for i, r in enumerate((20, 25, 30))]
    config = SessionConfig(policy=get_policy("foresight", sinks=4, recent=8), budget=48, chunk=16, limit=128,
                           blueprint=parse_blueprint(blueprint), spill=host_store())
    gen = torch.Generator().manual_seed(0)
    msgs = [torch.randint(0, 256, (24 if i < 3 else 16,), generator=gen).tolist() for i in range(31)]
    main = Session(engine, config)
    for m in msgs[:13]:
        main.append(m)
    fork, copy = main.fork(shared=True), main.fork()
    at_fork = set(fork.resident_logical().tolist())
    for m in msgs[13:]:
        close(fork.append(m, logits="all"), copy.append(m, logits="all"))
    assert fork.history == copy.history
    back = [i for op in fork.history if op["op"] == "rehydrate" for i in op["indices"]]
    assert set(back) & at_fork  # some are prefix rows the fork evicted (exported from the parent's buffers)


op = st.one_of(st.tuples(st.just("append"), st.integers(1, 20)), st.tuples(st.just("generate"), st.integers(1, 4)),
               st.tuples(st.just("drop"), st.floats(0.05, 0.5)), st.tuples(st.just("reposition"), st.just(0)),
               st.tuples(st.just("subfork"), st.just(0)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.booleans(), op), min_size=1, max_size=8), seed=st.integers(0, 10_000),
       policy=st.sampled_from(["h2o", "tova", "full"]))
def test_random_interleavings_match_copies(engine, ops, seed, policy):
    """Random ops on the main session and on a shared fork, interleaved (a `subfork` forks the fork again): each
    shared fork stays equal to a copy fork taken at the same moment; the main session to itself with no forks."""
    kw = {} if policy == "full" else dict(budget=24, chunk=8)
    main = engine.session(policy, **kw)
    main.append(toks(30, seed))
    alone = main.fork()
    pairs = [(main.fork(shared=True), main.fork())]
    rng = torch.Generator().manual_seed(seed)
    for on_main, (kind, arg) in ops:
        targets = [(main, alone)] if on_main else [pairs[-1]]
        if kind == "subfork":
            if not on_main:
                pairs.append((pairs[-1][0].fork(shared=True), pairs[-1][1].fork()))
            continue
        for s, twin in targets:
            if kind == "append":
                t = torch.randint(0, 256, (arg,), generator=rng).tolist()
                got, want = s.append(t, logits="all"), twin.append(t, logits="all")
                (torch.testing.assert_close if s is not main else _equal)(got, want)
            elif kind == "generate":
                assert s.generate(arg) == twin.generate(arg)
            elif kind == "drop":
                resident = s.resident_logical().tolist()
                k = min(len(resident) - 1, int(len(resident) * arg))
                if k > 0:
                    victims = [resident[i] for i in torch.randperm(len(resident), generator=rng)[:k].tolist()]
                    s.drop(victims)
                    twin.drop(victims)
            else:
                s.reposition()
                twin.reposition()
            assert s.resident_logical().tolist() == twin.resident_logical().tolist()
            assert s.resident_positions().tolist() == twin.resident_positions().tolist()
    _equal(main.last_logits, alone.last_logits)
    for s, twin in pairs:
        final = toks(3, seed + 1)
        close(s.append(final, logits="all"), twin.append(final, logits="all"))


def _equal(a: torch.Tensor, b: torch.Tensor, **_) -> None:
    assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["none", "cumulative", "window"])
def test_two_segment_attention_equals_dense_attention(mode):
    """The shared-prefix attention against the plain path over the concatenated (alive) keys: outputs and slot
    scores (a GQA layout: 6 query heads on 2 KV heads)."""
    g = torch.Generator().manual_seed(0)
    hkv, hq, d, n0, n_own, q = 2, 6, 8, 30, 5, 7
    pk, pv = torch.randn(hkv, n0, d, generator=g), torch.randn(hkv, n0, d, generator=g)
    alive = torch.rand(n0, generator=g) > 0.3
    k, v = torch.randn(1, hkv, n_own + q, d, generator=g), torch.randn(1, hkv, n_own + q, d, generator=g)
    query = torch.randn(1, hq, q, d, generator=g)
    layer = type("Layer", (), {"layer_idx": 0})()
    prefix = SharedPrefix(k=[pk], v=[pv], ref_k=None, alive=alive, sharers=None)
    shared = ForwardContext(n_old=int(alive.sum()) + n_own, score_mode=mode, window=3, prefix=prefix)
    got, _ = steward_attention(layer, query, k, v, None, steward=shared)
    dense_k = torch.cat([pk[:, alive][None], k], dim=2)
    dense_v = torch.cat([pv[:, alive][None], v], dim=2)
    plain = ForwardContext(n_old=shared.n_old, score_mode=mode, window=3)
    want, _ = steward_attention(layer, query, dense_k, dense_v, None, steward=plain)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if mode == "none":
        assert shared.scores is None
    else:
        torch.testing.assert_close(shared.scores, plain.scores, atol=1e-6, rtol=1e-5)


def test_bench_fork_plumbing(engine):
    from kvsteward.serve.bench.checks import bench_fork

    out = bench_fork(engine, resident=48, chunk=16, repeats=1)
    for policy in ("full", "h2o"):
        row = out[policy]
        assert row["resident"] == 48 and row["kv_bytes"] > 0
        assert all(row[k] > 0 for k in ("copy_fork_s", "shared_fork_s", "decode_step_s",
                                        "decode_step_with_shared_fork_s"))
