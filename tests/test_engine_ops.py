"""Cache operations against independent references: transformers' generate, a masked from-scratch forward, and a
sequential replay on transformers' own DynamicCache (kvsteward.serve.engine.reference)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.engine.reference import ReferenceSession
from kvsteward.serve.engine.session import CacheOpError

torch.set_num_threads(1)
ARCHS = ["llama", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def engine(request) -> Engine:
    return Engine(tiny_model(request.param, seed=3))


def rand_tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(engine: Engine) -> ReferenceSession:
    return ReferenceSession(engine.model, engine.rope.inv_freq, engine.rope.layout)


@pytest.mark.parametrize("chunk", [512, 7])
def test_full_engine_equals_transformers_generate(engine, chunk):
    prompt = rand_tokens(37, seed=1)
    s = engine.session("full", chunk=chunk)
    s.append(prompt)
    got = s.generate(24)
    want = engine.model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert got == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("policy", ["full", "h2o", "snapkv"])
def test_score_collection_does_not_change_outputs(engine, policy):
    """Score modes (tiled exact attention, windowed votes) must give the same logits as a plain forward."""
    tokens = rand_tokens(90, seed=2)
    s = engine.session(policy, budget=10_000, chunk=32)
    got = s.append(tokens, logits="all")
    with torch.no_grad():
        want = engine.model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_cumulative_scores_equal_eager_attention_weights():
    model = tiny_model("llama", seed=5)
    engine = Engine(model)
    tokens = rand_tokens(48, seed=4)
    s = engine.session("h2o", budget=10_000, chunk=48)
    s.append(tokens)
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            attn = model(torch.tensor([tokens]), output_attentions=True).attentions
    finally:
        model.config._attn_implementation = "sdpa"
    heads = attn[0].shape[1]
    want = sum(a[0].sum(dim=(0, 1)) for a in attn) / (heads * len(attn))
    torch.testing.assert_close(s.table.field("cumulative"), want, atol=1e-5, rtol=1e-5)


def test_drop_equals_masked_recomputation_at_unchanged_positions(engine):
    x, y = rand_tokens(30, seed=5), rand_tokens(9, seed=6)
    dropped = [0, 3, 4, 5, 17, 29]
    s = engine.session("full", chunk=8)
    s.append(x)
    s.drop(dropped)
    got = s.append(y, logits="all")
    n = len(x) + len(y)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[len(x):, dropped] = False  # only tokens appended after the drop stop seeing the dropped ones
    with torch.no_grad():
        want = engine.model(torch.tensor([x + y]), attention_mask=mask[None, None],
                            position_ids=torch.arange(n)[None]).logits[0, len(x):]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert s.next_pos == n  # the next position is not reduced by a drop
    assert s.resident_positions().tolist() == [p for p in range(n) if p not in dropped]


def test_reposition_equals_reference_with_new_positions(engine):
    x, y = rand_tokens(25, seed=7), rand_tokens(6, seed=8)
    s, ref = engine.session("full"), reference(engine)
    for sess in (s, ref):
        sess.append(x)
        sess.drop([2, 3, 10, 11, 12])
        sess.reposition()
    assert s.resident_positions().tolist() == list(range(20)) and s.next_pos == 20
    got = s.append(y, logits="all")
    torch.testing.assert_close(got, ref.append(y), atol=2e-5, rtol=1e-4)


def test_akv_worked_example_a1_1(engine):
    """AKV appendix A.1.1: A0 B1 C2 → drop B, repos → A0 C1; D at 2 → drop D; E at 3 → repos → A0 C1 E2; F at 3."""
    A, B, C, D, E, F = ([t] for t in rand_tokens(6, seed=9))
    s, ref = engine.session("full"), reference(engine)

    def both(op, *args):
        getattr(s, op)(*args)
        return getattr(ref, op)(*args)

    for tok in (A, B, C):
        both("append", tok)
    both("drop", [1])
    both("reposition")
    assert s.resident_positions().tolist() == [0, 1]
    want_d = both("append", D)
    assert s.resident_positions().tolist() == [0, 1, 2]  # D sees A0 C1 D2
    both("drop", [3])
    want_e = both("append", E)
    assert s.resident_positions().tolist() == [0, 1, 3]  # E sees A0 C1 E3 (a drop does not reduce the next position)
    both("reposition")
    assert s.resident_positions().tolist() == [0, 1, 2]
    want_f = both("append", F)
    assert s.resident_positions().tolist() == [0, 1, 2, 3]  # F sees A0 C1 E2 F3
    assert s.resident_logical().tolist() == [0, 2, 4, 5]
    # the logits at every step agree with the reference replay
    for want in (want_d, want_e, want_f):
        assert want.shape[-1] == engine.vocab_size
    torch.testing.assert_close(s.last_logits, want_f[-1], atol=2e-5, rtol=1e-4)


def test_history_is_identity(engine):
    """Same surviving tokens via different op orders → different states (AKV Figure 5)."""
    t = rand_tokens(6, seed=10)
    a = engine.session("full")
    a.append(t[:3])
    a.drop([1])
    a.append(t[3:])
    b = engine.session("full")
    b.append(t)
    b.drop([1])
    assert a.resident_logical().tolist() == b.resident_logical().tolist()
    assert a.history_key() != b.history_key()
    assert not torch.allclose(a.table.v[1][:, :5], b.table.v[1][:, :5])  # later tokens saw different contexts


op_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 12)),
        st.tuples(st.just("drop"), st.floats(0.05, 0.6)),
        st.tuples(st.just("reposition"), st.just(0)),
    ),
    min_size=1, max_size=8,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=op_strategy, seed=st.integers(0, 10_000))
def test_random_op_sequences_match_reference(engine, ops, seed):
    rng = torch.Generator().manual_seed(seed)
    s, ref = engine.session("full", chunk=5), reference(engine)
    for sess in (s, ref):
        sess.append(rand_tokens(8, seed))
    for op, arg in ops:
        if op == "append":
            toks = torch.randint(0, 256, (arg,), generator=rng).tolist()
            got, want = s.append(toks, logits="all"), ref.append(toks)
            torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
        elif op == "drop":
            resident = s.resident_logical().tolist()
            k = min(len(resident) - 1, max(0, int(len(resident) * arg)))
            if k == 0:
                continue
            pick = torch.randperm(len(resident), generator=rng)[:k].tolist()
            victims = [resident[i] for i in pick]
            s.drop(victims)
            ref.drop(victims)
        else:
            s.reposition()
            ref.reposition()
        assert s.resident_logical().tolist() == ref.logical
        assert s.resident_positions().tolist() == ref.positions
    final = rand_tokens(3, seed + 1)
    torch.testing.assert_close(s.append(final, logits="all"), ref.append(final), atol=5e-5, rtol=1e-4)


def _snapshot(s):
    return (s.history_key(), list(s.tokens), bytes(s.status), s.next_pos, s.table.n,
            [k[:, : s.table.n].clone() for k in s.table.k])


def _assert_same(a, b):
    assert a[:5] == b[:5]
    assert all(torch.equal(x, y) for x, y in zip(a[5], b[5], strict=True))


def test_bad_input_raises_and_leaves_session_unchanged(engine):
    s = engine.session("full")
    with pytest.raises(CacheOpError, match="empty cache"):
        s.reposition()
    s.append(rand_tokens(10, seed=11))
    s.drop([4])
    before = _snapshot(s)
    bad = [
        (lambda: s.drop([99]), "unknown"),
        (lambda: s.drop([4]), "already dropped"),
        (lambda: s.drop([5, 5]), "already dropped"),
        (lambda: s.drop([2, 99]), "unknown"),  # partially valid: nothing applied
        (lambda: s.drop(["x"]), "not an integer"),
        (lambda: s.append([]), "at least one token"),
        (lambda: s.append([1, 100_000]), "not an integer in"),
        (lambda: s.append([1], continue_message=False) if False else s.append([-1]), "not an integer in"),
    ]
    for fn, msg in bad:
        with pytest.raises(CacheOpError, match=msg):
            fn()
        _assert_same(before, _snapshot(s))
    with pytest.raises(CacheOpError, match="must exceed budget"):
        engine.session("pace", budget=64, chunk=32, limit=96)
    with pytest.raises(CacheOpError, match="needs a budget"):
        engine.session("h2o")


def test_unsupported_rope_type_is_refused():
    from kvsteward.kernels.rope import UnsupportedRope

    model = tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedRope, match="dynamic"):
        Engine(model)


def test_bf16_engine_matches_reference_and_keeps_fp32_reference_keys():
    model = tiny_model("llama", seed=6, dtype=torch.bfloat16)
    engine = Engine(model)
    s, ref = engine.session("full", chunk=8), reference(engine)
    x = rand_tokens(30, seed=12)
    for sess in (s, ref):
        sess.append(x)
        sess.drop([1, 2, 9])
        sess.reposition()
    assert s.table.k[0].dtype == torch.bfloat16 and s.table.ref_k[0].dtype == torch.float32
    y = rand_tokens(5, seed=13)
    torch.testing.assert_close(s.append(y, logits="all"), ref.append(y), atol=3e-2, rtol=3e-2)
