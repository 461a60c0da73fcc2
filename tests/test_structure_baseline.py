"""The structural features of a decision on a hand-worked context, what a deleted response contributes (nothing), and
the `structure` baseline: it recovers a label that depends on a followed identifier, which no word model sees."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import math

import numpy as np
import pytest

from kvsteward.synth.traces import baselines as bl
from kvsteward.synth.traces.decisions import Decision, decisions_at
from kvsteward.synth.traces.structure import FEATURES, content_words, identifiers


def _ctx() -> list[dict]:
    return [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Resolve ticket T-1392 about the kitchen parcel."},
        {"role": "assistant", "content": "Opening ticket T-1392."},
        {"role": "tool", "content": "[cursor 3] Ticket T-1392 order: O-2124 customer C-628 issue: late parcel"},
        {"role": "assistant", "content": "Pulling up order O-2124."},
        {"role": "tool", "content": "[cursor 5] Order O-2124 items: rice cooker (kitchen) status: transit"},
        {"role": "assistant", "content": "Searching delayed kitchen."},
        {"role": "tool", "content": "[cursor 7] Results: KB-9228 kitchen delays, KB-6000 parcel guide"},
    ]


def _features(decision: Decision) -> dict[str, float]:
    return dict(zip(FEATURES, decision.structure, strict=True))


def test_identifiers_and_words():
    assert identifiers("Order O-2124 for C-628, code 9911 and 42") == {"O-2124", "C-628", "9911"}
    assert content_words("The kitchen parcel: rice, kitchen, with that") == {"kitchen", "parcel", "rice"}


def test_features_of_a_hand_worked_context():
    msgs = _ctx()
    got = {d.cursor: _features(d) for d in decisions_at(msgs, [3, 5, 7], 8)}
    assert set(got) == {3, 5}  # cursor 7 is unread: no decision
    t, o = got[3], got[5]
    # cursor 3 introduced O-2124 and C-628 (T-1392 was in the task): the agent followed O-2124, C-628 is pending
    assert (t["n_new_ids"], t["frac_new_followed"], t["n_new_pending"], t["has_new_ids"]) == (2, 0.5, 1, 1)
    assert t["n_task_ids"] == 1 and t["n_task_words"] == 2  # T-1392; "ticket", "parcel"
    # words shared with the other open responses: cursor 5 "order", cursor 7 "parcel"
    assert (t["max_response_words"], t["sum_response_words"]) == (1, 2)
    # later messages naming one of its ids: "Pulling up order O-2124." and cursor 5; the last of them (cursor 5) has
    # one agent message after it. Its own (first) id, T-1392, no later message names.
    assert t["n_later_mentions"] == 2 and t["last_mention_age"] == 1 and t["own_id_later"] == 0
    assert t["n_later_agent_words"] == 1  # "order"
    assert t["log_steps_since"] == pytest.approx(math.log1p(2)) and t["recency"] == 1 and t["n_read"] == 2
    assert t["rel_pos"] == pytest.approx(3 / 8) and t["log_len"] == pytest.approx(math.log1p(9))
    # cursor 5 introduced nothing new (O-2124 was in cursor 3); "kitchen" is in the task and in cursor 7
    assert (o["n_new_ids"], o["has_new_ids"], o["n_later_mentions"], o["own_id_later"]) == (0, 0, 0, 0)
    assert o["n_task_words"] == 1 and o["max_response_words"] == 1 and o["recency"] == 0
    assert o["last_mention_age"] == 1  # steps since, as no later message names it


def test_a_deleted_response_contributes_nothing():
    msgs = _ctx()
    without = {d.cursor: d.structure for d in decisions_at(msgs, [3, 7], 8)}
    masked = list(msgs)
    masked[5] = {"role": "tool", "content": "[cursor 5] (deleted)"}
    assert without == {d.cursor: d.structure for d in decisions_at(masked, [3, 7], 8)}
    f = dict(zip(FEATURES, without[3], strict=True))
    assert f["n_later_mentions"] == 1 and f["n_read"] == 1  # only the agent's "Pulling up order O-2124." is left


def _trace_decisions(n: int, seed: int) -> list[Decision]:
    """n contexts in which the first response is still needed exactly when the agent has not yet followed the id it
    introduced; the text around it is the same words either way, so only the identifiers tell."""
    rng = np.random.default_rng(seed)
    call = '\n<tool_call>\n{"name": "open", "arguments": {}}\n</tool_call>'
    out = []
    for i in range(n):
        ref = f"R-{rng.integers(1000, 9999)}"
        other = f"R-{rng.integers(1000, 9999)}"
        followed = bool(rng.integers(2))
        msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "Look into the account."},
                {"role": "assistant", "content": "Opening it." + call},
                {"role": "tool", "content": f"[cursor 3] Account record lists {ref}."},
                {"role": "assistant", "content": f"Next I open {ref if followed else other}." + call},
                {"role": "tool", "content": "[cursor 5] Entry details."},
                {"role": "assistant", "content": "Noted." + call},
                {"role": "tool", "content": "[cursor 7] More details."}]
        out += decisions_at(msgs, [3, 5, 7], 8, lambda c, f=followed: c == 5 or (c == 3 and f), f"t{i}")
    return out


def test_the_structure_baseline_learns_a_followed_identifier():
    train, test = _trace_decisions(80, 0), _trace_decisions(40, 1)
    y = np.array([d.label for d in test])
    s = bl.StructureClassifier().fit(train)
    assert bl.metrics(y, s.predict(test))["f1"] == 1.0
    text = bl.TextClassifier().fit(train)  # the words are the same on both sides; the ids are new in each trace
    assert bl.metrics(y, text.predict(test))["f1"] < 0.9


def test_the_structure_baseline_refuses_decisions_without_features(tmp_path):
    hand = [Decision(f"t{i}", "x", 9, c, c == 3, "", "task", "body", "note", "call", 1, 0) for i in range(6)
            for c in (3, 5)]
    with pytest.raises(ValueError, match="structural features"):
        bl.StructureClassifier().fit(hand)
    fitted = bl.StructureClassifier().fit(_trace_decisions(30, 2))
    bl.save_baselines({"structure": fitted}, tmp_path)
    back = bl.load_baselines(tmp_path)["structure"]
    probe = _trace_decisions(10, 3)
    assert np.array_equal(back.scores(probe), fitted.scores(probe))
