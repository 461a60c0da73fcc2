"""The per-response decision (`--trigger scores`, issue 45.1): a header per open response taken from the response
itself, one forward, P(still needed) at each response's slot; trained where it is served.

References: the slots are found again by decoding the row's own tokens (not by `slot_tokens`), the labels from the
hindsight target, and the served P(no) from one plain HF forward over the training row's tokens.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from kvsteward.synth.traces import dataset as dsm
from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.envs import generate
from kvsteward.train.loss import IGNORE

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of Norland"}}\n</tool_call>'
MESSAGES = [
    {"role": "system", "content": "You are a research agent."},
    {"role": "user", "content": "What is the capital of Norland?"},
    {"role": "assistant", "content": "Let me search.\n" + CALL + "\n" + CALL.replace("Norland", "Sudland")},
    {"role": "tool", "content": "[cursor 3] Norland: a kingdom; capital Vel.\nPopulation 3M."},
    {"role": "tool", "content": "[cursor 4] Sudland: a republic."},
    {"role": "assistant", "content": "Norland's capital is Vel."},
]


def test_scores_trigger_hand_worked():
    text = hs.delete_trigger([3, 4], MESSAGES, "scores")
    assert text.split("\n") == [
        "Memory management mode",
        "Task: What is the capital of Norland?",
        hs.SCORE_QUESTION,
        '[3] search(query="capital of Norland") -> Norland: a kingdom; capital Vel. | still needed?',
        '[4] search(query="capital of Sudland") -> Sudland: a republic. | still needed?',
    ]
    ends = hs.score_slot_ends(text, [3, 4])
    assert [text[e - len(hs.SLOT_MARK):e] for e in ends] == [hs.SLOT_MARK] * 2
    with pytest.raises(ValueError, match="no score slot for cursor 5"):
        hs.score_slot_ends(text, [3, 5])


@pytest.fixture(scope="module")
def traces():
    return generate("research", 6, 5)


@pytest.fixture(scope="module")
def rows(tok, traces):
    dd = dsm.build_dataset(traces, tok, dsm.HindsightConfig(every=2, max_tokens=4096, trigger="scores", plan=False))[0]
    out = [r for split in dd.values() for r in split if r["kind"] == "delete"]
    assert len(out) >= 6
    return out


def _cursor_of_slot(tok, row, k: int) -> int:
    """Decode the row's tokens up to the labelled position k: the last trigger line before it names the cursor."""
    text = tok.decode(row["input_ids"][row["fork_at"]:k])
    assert text.endswith(hs.SLOT_MARK), text[-60:]
    line = text.rsplit("\n", 1)[-1]
    return int(line[1:line.index("]")])


def test_each_open_response_is_labelled_once_at_its_slot_with_the_hindsight_answer(tok, rows):
    yes, no = (tok.encode(a, add_special_tokens=False)[0] for a in hs.ANSWERS)
    for row in rows:
        labelled = [k for k, y in enumerate(row["labels"]) if y != IGNORE]
        target = set(json.loads(row["target"])["del_cursors"])
        assert [_cursor_of_slot(tok, row, k) for k in labelled] == sorted(row["open_cursors"])
        for k in labelled:
            c = _cursor_of_slot(tok, row, k)
            assert row["labels"][k] == (no if c in target else yes)
            assert row["input_ids"][k] not in (yes, no)  # the answer is never written into the context
        msgs = json.loads(row["messages"])
        assert msgs[-1]["role"] == "user" and msgs[-1]["content"].startswith(hs.DELETE_TRIGGER)
        assert all(row["labels"][k] == IGNORE for k in range(row["fork_at"]))


def test_the_loss_reads_exactly_the_slots(rows):
    from kvsteward.train.loss import target_positions

    row = rows[0]
    labels = torch.tensor([row["labels"]])
    _, t, y = target_positions(labels, torch.tensor([True]))
    assert (t + 1).tolist() == [k for k, v in enumerate(row["labels"]) if v != IGNORE]
    assert y.tolist() == [v for v in row["labels"] if v != IGNORE]


def test_the_served_trigger_is_the_trained_piece_and_p_no_equals_a_plain_forward(rows):
    """`serve.manager.scores`: the fork appends the row's own trigger tokens and reads the slots the loss trains; its
    P(no) equals the softmax of one HF forward over the row (no engine), and the threshold decides."""
    from kvsteward.serve.manager.scores import trigger_ids
    from kvsteward.serve.manager.thread import run_aux
    from kvsteward.serve.server.testing import tiny_chat_engine

    engine = tiny_chat_engine(seed=1)
    engine.trigger_style = "scores"
    tok = engine.tokenizer
    yes, no = (tok.encode(a, add_special_tokens=False)[0] for a in hs.ANSWERS)
    for row in rows[:4]:
        msgs = json.loads(row["messages"])[:-1]
        ids, slots = trigger_ids(tok, msgs, row["open_cursors"])
        fork_at = row["fork_at"]
        assert ids == row["input_ids"][fork_at:]
        labelled = [k for k, v in enumerate(row["labels"]) if v != IGNORE]
        assert [fork_at + s + 1 for s in slots] == labelled
        main = engine.session("full")
        main.append(row["input_ids"][:fork_at], kind="user", logits=None)
        decision = run_aux(main, tok, msgs, row["open_cursors"], use_adapter=False, keep_unread=False,
                           min_confidence=0.5)
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
        truth = torch.softmax(logits[[k - 1 for k in labelled]][:, [yes, no]].double(), dim=-1)[:, 1]
        got = torch.tensor([decision.confidence[c] for c in sorted(row["open_cursors"])], dtype=torch.float64)
        torch.testing.assert_close(got, truth, atol=1e-4, rtol=0)
        assert decision.del_cursors == [c for c in sorted(row["open_cursors"]) if decision.confidence[c] >= 0.5]
        none = run_aux(main, tok, msgs, row["open_cursors"], use_adapter=False, keep_unread=False,
                       min_confidence=1.0 + 1e-9)
        assert none.del_cursors == [] and json.loads(none.text) == {"del_cursors": []}


def test_decision_validation_replays_scores_rows(tok, rows):
    from kvsteward.train.data import dataset_trigger
    from kvsteward.train.decisions import decision_rows

    ds = __import__("datasets").Dataset.from_list(rows)
    parsed = decision_rows(ds, tok)
    assert len(parsed) == len(rows)
    for row, d in zip(rows, parsed, strict=True):
        assert d.open_cursors == tuple(sorted(row["open_cursors"]))
        assert [row["fork_at"] + s + 1 for s in d.slots] == [k for k, v in enumerate(row["labels"]) if v != IGNORE]
    assert dataset_trigger("/nonexistent", ds) == "scores"


def test_scores_refusals():
    with pytest.raises(ValueError, match="--pack"):
        dsm.HindsightConfig(pack=True, trigger="scores").validate()
    with pytest.raises(ValueError, match="needs the context's messages"):
        hs.delete_trigger([3], None, "scores")


def test_the_audit_reads_scores_rows_as_it_reads_list_rows(tok, traces):
    """`decisions_from_split` over a `scores` dataset (rows end with the trigger, no assistant target) gives the same
    decisions, labels included, as over the list-decoder dataset of the same traces and seed (the audit and the rule
    fits of `steward synth hindsight --trigger scores` ran on that)."""
    from kvsteward.synth.traces.decisions import decisions_from_split

    def decisions(trigger):
        dd = dsm.build_dataset(traces, tok, dsm.HindsightConfig(every=2, max_tokens=4096, trigger=trigger,
                                                                plan=False))[0]
        rows = [r for split in dd.values() for r in split if r["kind"] == "delete"]
        return [(d.trace_id, d.boundary, d.cursor, d.label, d.structure) for d in decisions_from_split(rows)]

    scores = decisions("scores")
    assert scores and scores == decisions("ids")
    assert {label for *_, label, _ in scores} == {True, False}
