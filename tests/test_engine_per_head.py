"""Per-head selection (`SessionConfig.per_head`): each (layer, KV head) keeps its own top-B slots by its own attention
scores, as kvpress's per-head presses do. Checked against the independent reference (transformers' DynamicCache and
its own sdpa attention, each (layer, KV head)'s hidden columns masked from the replayed `hide` ops) over random op
sequences, with bounded positions (renumbers) and drops / repositions between appends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.policies import get_policy
from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.engine.session import CacheOpError, Session, SessionConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engine(request) -> Engine:
    model = tiny_model(request.param, seed=5)
    with torch.no_grad():  # sharper attention than random init gives, so that heads disagree on what to keep
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    return Engine(model)


def tokens(n: int, rng: torch.Generator) -> list[int]:
    return torch.randint(0, 256, (n,), generator=rng).tolist()


def check_heads(s, budget: int) -> None:
    """Each head sees at most B slots (its protected ones included) and every resident slot is seen by some head."""
    alive = s.table.field("head_alive")
    assert int(alive.sum(dim=0).max()) <= budget
    assert bool(alive.any(dim=1).all())


op_strategy = st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 12)),
                                 st.tuples(st.just("drop"), st.floats(0.05, 0.5)),
                                 st.tuples(st.just("reposition"), st.just(0))), min_size=1, max_size=7)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=op_strategy, seed=st.integers(0, 10_000), policy=st.sampled_from(["h2o", "snapkv", "tova"]),
       bounded=st.booleans(), per_layer=st.booleans())
def test_random_op_sequences_match_the_masked_reference(engine, ops, seed, policy, bounded, per_layer):
    rng = torch.Generator().manual_seed(seed)
    budget = 10
    s = engine.session(policy, budget=budget, chunk=5, limit=40 if bounded else None, per_head=not per_layer,
                       per_layer=per_layer, sinks=2, recent=3)
    s.append(tokens(14, rng))
    for op, arg in ops:
        if op == "append":
            toks = tokens(arg, rng)
            got = s.append(toks, logits="last")
            ref = ReferenceSession.with_rope(engine.model, engine.rope)
            torch.testing.assert_close(got, ref.replay(s.history)[-1], atol=5e-5, rtol=1e-4)
            assert s.resident_logical().tolist() == ref.logical and s.resident_positions().tolist() == ref.positions
        elif op == "drop":
            resident = s.resident_logical().tolist()
            k = min(len(resident) - 1, int(len(resident) * arg))
            if k:
                s.drop([resident[i] for i in torch.randperm(len(resident), generator=rng)[:k].tolist()])
        else:
            s.reposition()
        check_heads(s, budget)
        if per_layer:  # a layer's KV heads share one selection
            alive = s.table.field("head_alive").view(s.table.n, engine.n_layers, engine.n_kv_heads)
            assert bool((alive == alive[:, :, :1]).all())
    hides = sum(len(op["pairs"]) for op in s.history if op["op"] == "hide")
    event(f"{policy}: hidden pairs > 0: {hides > 0}")
    if policy == "tova":  # each head's (layer's) last query votes alone: they always disagree somewhere
        assert hides > 0


def test_heads_keep_different_slots_and_resident_is_their_union(engine):
    """The heads disagree: more slots stay resident than one head keeps, each head sees exactly B after an eviction
    (none protected here), and the uniform policy at the same B keeps B slots whose logits differ."""
    rng = torch.Generator().manual_seed(1)
    prompt = tokens(40, rng)
    s = engine.session("tova", budget=12, chunk=40, per_head=True, sinks=0, recent=0)
    u = engine.session("tova", budget=12, chunk=40, sinks=0, recent=0)
    a, b = s.append(prompt), u.append(prompt)
    torch.testing.assert_close(a, b)  # one chunk: the eviction comes after the forward
    alive = s.table.field("head_alive")
    assert (alive.sum(dim=0) == 12).all() and s.resident > 12 and u.resident == 12
    nxt = tokens(3, rng)
    assert not torch.allclose(s.append(nxt), u.append(nxt), atol=1e-4)
    ref = ReferenceSession.with_rope(engine.model, engine.rope)
    torch.testing.assert_close(s.last_logits, ref.replay(s.history)[-1], atol=5e-5, rtol=1e-4)


def test_per_layer_selection_keeps_one_set_per_layer_on_the_heads_averaged_scores(engine):
    """Per layer: every KV head of a layer keeps the top-B of the layer's mean scores (computed here from the per-head
    scores of the same state before the eviction), and layers disagree, so the union exceeds B."""
    rng = torch.Generator().manual_seed(2)
    prompt = tokens(40, rng)
    probe = engine.session("tova", budget=100, chunk=40, per_head=True, sinks=0, recent=0)  # scores, no eviction
    probe.append(prompt)
    layer_scores = probe.table.field("head_score").view(40, engine.n_layers, engine.n_kv_heads).mean(dim=2)
    s = engine.session("tova", budget=12, chunk=40, per_layer=True, sinks=0, recent=0)
    s.append(prompt)
    alive = s.table.field("head_alive").view(s.table.n, engine.n_layers, engine.n_kv_heads)
    logical = s.resident_logical()
    for layer in range(engine.n_layers):
        expected = set(torch.topk(layer_scores[:, layer], 12).indices.tolist())
        assert set(logical[alive[:, layer, 0]].tolist()) == expected
    assert s.resident > 12 and bool((alive == alive[:, :, :1]).all())
    ref = ReferenceSession.with_rope(engine.model, engine.rope)
    torch.testing.assert_close(s.append(tokens(3, rng)), ref.replay(s.history)[-1], atol=5e-5, rtol=1e-4)
    with pytest.raises(CacheOpError, match="per_head=True"):
        Session(engine, SessionConfig(policy=get_policy("tova"), budget=8, per_layer=True))


def test_what_per_head_selection_refuses(engine):
    with pytest.raises(CacheOpError, match="scores by attention"):
        engine.session("streaming", budget=8, per_head=True)
    with pytest.raises(CacheOpError, match="refresh"):
        engine.session("pace-refresh-h2o", budget=8, limit=64, chunk=8, per_head=True)
    s = engine.session("h2o", budget=8, per_head=True)
    s.append([1, 2, 3])
    with pytest.raises(CacheOpError, match="shared fork"):
        s.fork(shared=True)
    assert s.fork().resident == 3
