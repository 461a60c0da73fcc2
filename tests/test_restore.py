"""Segment-batch restore: one forward over an op history equals the sequential replay of the ops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.restore import plan_history, restore

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engine(request) -> Engine:
    return Engine(tiny_model(request.param, seed=11))


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same_state(a, b):
    assert a.resident_logical().tolist() == b.resident_logical().tolist()
    assert a.resident_positions().tolist() == b.resident_positions().tolist()
    assert a.next_pos == b.next_pos and a.n_logical == b.n_logical
    n = a.table.n
    for layer in range(a.table.n_layers):
        torch.testing.assert_close(a.table.k[layer][:, :n], b.table.k[layer][:, :n], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(a.table.v[layer][:, :n], b.table.v[layer][:, :n], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(a.last_logits, b.last_logits, atol=5e-5, rtol=1e-4)


def test_plan_of_the_akv_worked_example():
    hist = [{"op": "append", "step": i, "kind": "user", "tokens": [t]} for i, t in enumerate([10, 11, 12])]
    hist += [{"op": "drop", "indices": [1]}, {"op": "reposition"},
             {"op": "append", "step": 3, "kind": "user", "tokens": [13]}, {"op": "drop", "indices": [3]},
             {"op": "append", "step": 4, "kind": "user", "tokens": [14]}, {"op": "reposition"},
             {"op": "append", "step": 5, "kind": "user", "tokens": [15]}]
    plan = plan_history(hist)
    d, e, f = plan.segments[3], plan.segments[4], plan.segments[5]
    seen = lambda seg: (plan.original_pos[seg.visible] + seg.delta).tolist()  # noqa: E731
    assert plan.original_pos.tolist() == [0, 1, 2, 2, 3, 3]  # D at 2, E at 3, F at 3
    assert d.visible.tolist() == [0, 2] and seen(d) == [0, 1]  # D sees A0 C1
    assert e.visible.tolist() == [0, 2] and seen(e) == [0, 1]  # E sees A0 C1 (D dropped)
    assert f.visible.tolist() == [0, 2, 4] and seen(f) == [0, 1, 2]  # F sees A0 C1 E2
    assert plan.final_pos == [0, 1, 2, 3] and plan.resident == [0, 2, 4, 5]


@pytest.mark.parametrize("policy, kw", [("full", {}), ("h2o", {"budget": 24, "chunk": 8}),
                                        ("pace", {"budget": 24, "chunk": 8, "limit": 40})])
def test_restore_equals_sequential_with_evictions_and_renumbers(engine, policy, kw):
    s = engine.session(policy, **kw)
    for i in range(6):
        s.append(toks(11, i), kind="tool" if i % 2 else "user")
        if i == 2:
            s.drop(s.resident_logical()[2:5].tolist())
        if i == 3 and policy == "full":
            s.reposition()
    s.generate(5)
    r = restore(engine, s.config, s.history)
    assert_same_state(r, s)
    if policy != "full":
        torch.testing.assert_close(r.table.field("cumulative"), s.table.field("cumulative"), atol=1e-5, rtol=1e-4)
    # and both continue identically, evictions included
    torch.testing.assert_close(r.append(toks(9, 99), logits="all"), s.append(toks(9, 99), logits="all"),
                               atol=5e-5, rtol=1e-4)
    assert r.resident_logical().tolist() == s.resident_logical().tolist()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["append", "drop", "reposition"]), min_size=1, max_size=7),
       seed=st.integers(0, 1000))
def test_restore_random_histories(engine, ops, seed):
    gen = torch.Generator().manual_seed(seed)
    s = engine.session("full", chunk=4)
    s.append(toks(6, seed))
    for op in ops:
        if op == "append":
            s.append(toks(int(torch.randint(1, 9, (1,), generator=gen)), seed + 1))
        elif op == "drop" and s.resident > 1:
            s.drop([s.resident_logical()[int(torch.randint(0, s.resident, (1,), generator=gen))].item()])
        elif op == "reposition":
            s.reposition()
    assert_same_state(restore(engine, s.config, s.history), s)


def test_window_policies_refuse_restore(engine):
    s = engine.session("snapkv", budget=8)
    s.append(toks(5, 1))
    with pytest.raises(ValueError, match="window vote"):
        restore(engine, s.config, s.history)


def test_bench_restore_agrees_with_sequential_replay():
    from kvsteward.serve.bench.checks import bench_restore

    out = bench_restore(Engine(tiny_model("llama", layers=2)), messages=6, tokens_per_message=32)
    assert out["max_abs_logit_diff"] < 1e-4 and out["ops"] > 6
