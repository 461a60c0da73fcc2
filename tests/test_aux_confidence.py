"""The confidence rule of the aux thread (`min_confidence`): P(id listed) over the manager's constrained distribution
of deletion lists, checked against the same distribution recomputed from scratch by the HF model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.manager.decode import PREFIX, _candidates, closing_tokens, confident_del_cursors, valid_tail
from kvsteward.serve.manager.thread import run_aux
from kvsteward.serve.manager.worker import AuxConfig
from kvsteward.synth.chat import message_token_ids

torch.set_num_threads(1)
MESSAGES = [{"role": "user", "content": "Find the founder of Acme."},
            {"role": "assistant", "content": "search(Acme)"}, {"role": "tool", "content": "[cursor 2] Acme ..."},
            {"role": "assistant", "content": "open(doc 9)"}, {"role": "tool", "content": "[cursor 4] founded by X"},
            {"role": "assistant", "content": "read it"}, {"role": "tool", "content": "[cursor 6] X was born ..."}]
OPEN = [2, 4, 6]


@pytest.fixture(scope="module")
def engine(tok):
    return Engine(tiny_model("llama", vocab=len(tok), seed=5), tok)


def _trigger_state(engine, tok, seed: int, sharpness: float):
    """A session right before the forced opener (the state `aux_steps` hands the decoder): a random model whose
    candidate logits are scaled by `sharpness` (a few branches carry the mass, as with a trained manager)."""
    torch.manual_seed(seed)
    engine.model.lm_head.weight.data.normal_().mul_(sharpness)
    s = engine.session("full")
    for ids in message_token_ids(tok, MESSAGES):
        s.append(ids)
    s.append(tok.encode("Memory management mode\nOpen cursors: 2, 4, 6", add_special_tokens=False), logits="last")
    return s


def _reference(engine, tok, prefix_ids: list[int], max_tokens: int, prune: float, close_bias: float = 0.0):
    """The list distribution by brute force, independent of `Session`: every grammar path enumerated depth first,
    each prefix scored by a fresh HF forward over the whole token sequence; paths below `prune` are not followed."""
    cand_ids, cand_texts = _candidates(tok)
    closing = set(closing_tokens(tok))
    allowed = frozenset(OPEN)
    lists: dict[tuple[int, ...], float] = {}

    def walk(ids: list[int], tail: str, logp: float, used: int) -> None:
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0, -1].float()
        logits = logits[cand_ids] + torch.tensor([close_bias if t in closing else 0.0 for t in cand_ids])
        valid = [(k, valid_tail(tail + cand_texts[k], allowed)) for k in range(len(cand_ids))]
        valid = [(k, done) for k, (ok, done) in valid if ok]
        logq = torch.log_softmax(logits[[k for k, _ in valid]], 0).tolist()
        for (k, done), q in zip(valid, logq, strict=True):
            if logp + q < math.log(prune):
                continue
            if done:
                key = tuple(sorted(json.loads(PREFIX + tail + cand_texts[k])["del_cursors"]))
                lists[key] = lists.get(key, 0.0) + math.exp(logp + q)
            elif used + 1 < max_tokens:
                walk(ids + [cand_ids[k]], tail + cand_texts[k], logp + q, used + 1)

    walk(prefix_ids + tok.encode(PREFIX, add_special_tokens=False), "", 0.0, 0)
    return lists


# (seed, close bias) where the random manager is torn between several lists (a negative bias: it lists ids at all)
TORN = [(1, -6.0), (3, -6.0), (5, -8.0)]


@pytest.mark.parametrize("seed, close_bias", TORN)
def test_confidences_are_the_list_probabilities_recomputed_from_scratch(engine, tok, seed, close_bias):
    s = _trigger_state(engine, tok, seed, sharpness=1.0)
    prefix = list(s.tokens)
    d = confident_del_cursors(s.fork(), tok, OPEN, 0.5, max_tokens=10, close_bias=close_bias, prune=0.02,
                              max_forwards=10_000)
    ref = _reference(engine, tok, prefix, max_tokens=10, prune=0.02, close_bias=close_bias)
    assert len(ref) >= 3 and sum(0.05 < d.confidence[c] < 0.95 for c in OPEN) >= 2, (ref, d.confidence)
    for c in OPEN:
        want = sum(p for lst, p in ref.items() if c in lst)
        assert d.confidence[c] == pytest.approx(want, abs=1e-4), (c, d.confidence, ref)
    assert d.del_cursors == sorted(c for c in OPEN if d.confidence[c] >= 0.5)
    assert json.loads(d.text) == {"del_cursors": d.del_cursors} and not d.truncated
    assert sum(ref.values()) <= 1 + 1e-6


@pytest.mark.parametrize("seed", [12, 14, 19, 10])
def test_a_certain_manager_deletes_its_greedy_list(engine, tok, seed):
    """When every step has one candidate with nearly all the mass, the lists' distribution is a point: the confidence
    rule deletes exactly what greedy decoding lists, at any threshold (these seeds list [4, 6], [2], [2, 6], [])."""
    s = _trigger_state(engine, tok, seed, sharpness=1e3)
    greedy = run_aux(s, tok, MESSAGES, OPEN, max_tokens=16, keep_unread=False)
    assert greedy.del_cursors or seed == 10
    for tau in (0.3, 0.9, 1.0 - 1e-6):
        d = run_aux(s, tok, MESSAGES, OPEN, max_tokens=16, keep_unread=False, min_confidence=tau)
        assert d.del_cursors == greedy.del_cursors, (tau, d.confidence)


def test_thresholds_nest_and_the_bounds_only_lose_mass(engine, tok):
    """A higher threshold deletes a subset; a coarser prune or a smaller forward budget only lowers confidences (they
    are lower bounds: the rule errs toward keeping)."""
    s = _trigger_state(engine, tok, 3, sharpness=1.0)
    kw = {"max_tokens": 12, "close_bias": -6.0}
    full = confident_del_cursors(s.fork(), tok, OPEN, 0.5, prune=0.005, max_forwards=10_000, **kw)
    assert sum(0.05 < full.confidence[c] < 0.95 for c in OPEN) >= 2
    lists = [set(confident_del_cursors(s.fork(), tok, OPEN, tau, prune=0.005, max_forwards=10_000, **kw).del_cursors)
             for tau in (0.05, 0.2, 0.5, 0.8, 0.99)]
    assert lists[0] == set(OPEN) and lists[-1] == set() and len({frozenset(x) for x in lists}) >= 3
    for lower, higher in zip(lists, lists[1:], strict=False):
        assert higher <= lower
    for bounds in ({"prune": 0.1, "max_forwards": 10_000}, {"prune": 0.005, "max_forwards": 4}):
        coarse = confident_del_cursors(s.fork(), tok, OPEN, 0.5, **bounds, **kw)
        assert coarse.tokens < full.tokens
        assert all(coarse.confidence[c] <= full.confidence[c] + 1e-9 for c in OPEN)
        assert any(coarse.confidence[c] < full.confidence[c] - 1e-3 for c in OPEN)
    none = confident_del_cursors(s.fork(), tok, OPEN, 0.5, prune=0.005, max_forwards=0, **kw)
    assert none.del_cursors == [] and none.truncated and none.tokens == 0


def test_the_main_session_is_untouched(engine, tok):
    s = _trigger_state(engine, tok, 3, sharpness=1.0)
    key, n, k0 = s.history_key(), s.table.n, s.table.k[0][:, :s.table.n].clone()
    d = run_aux(s, tok, MESSAGES, OPEN, max_tokens=12, keep_unread=False, min_confidence=0.5, close_bias=-6.0)
    assert d.tokens > 3  # branches were decoded on copies of the fork
    assert s.history_key() == key and s.table.n == n and torch.equal(s.table.k[0][:, :n], k0)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), True, "0.9"])
def test_min_confidence_must_be_a_probability(bad):
    with pytest.raises(ValueError, match="min_confidence"):
        AuxConfig(min_confidence=bad).validate()
    AuxConfig(min_confidence=0.9).validate()
    AuxConfig(min_confidence=1).validate()
    AuxConfig(min_confidence=None).validate()
