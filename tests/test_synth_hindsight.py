"""Hindsight labels: last use on hand-built traces, and properties over generated and random traces."""

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.solver import TraceConfig
from kvsteward.synth.traces.stats import delete_row_errors
from kvsteward.synth.traces.tasks import FIELD_WORDS, RECAP_REQUEST
from kvsteward.synth.traces.toolcall import cursor_content
from kvsteward.synth.traces.trace import Trace


def hand_trace(roles: str, reads: dict[int, list[int]]) -> Trace:
    """roles: one letter per message, s/u/a/t (tool messages get their cursor tag)."""
    names = {"s": "system", "u": "user", "a": "assistant", "t": "tool"}
    msgs = [{"role": names[r], "content": cursor_content(i, f"body {i}") if r == "t" else f"{names[r]} {i}"}
            for i, r in enumerate(roles)]
    t = Trace("hand", "train", msgs, reads)
    t.validate()
    return t


# s u a t a t a t a t a   (cursors 3, 5, 7, 9)
HAND = hand_trace("suatatatata", {4: [3], 6: [5], 8: [7, 3], 10: [9, 5]})


def test_last_use_hand_built():
    assert HAND.cursors() == [3, 5, 7, 9]
    assert HAND.last_use() == {3: 8, 5: 10, 7: 8, 9: 10}
    assert HAND.readers() == {3: [4, 8], 5: [6, 10], 7: [8], 9: [10]}
    unread = hand_trace("suatata", {4: [3]})
    assert unread.last_use() == {3: 4, 5: -1}


def test_expired_and_targets_hand_built():
    # boundary 6 (after cursor 5): cursor 3 is read again at 8 → not expired; nothing expired yet.
    assert hs.expired(HAND, 6) == []
    # boundary 10 (after cursor 9): 3 and 7 were last used at 8 → expired; 5 is read at 10.
    assert hs.expired(HAND, 10) == [3, 7]
    assert hs.delete_target([3, 5, 7, 9], HAND, 10) == {"del_cursors": [3, 7]}
    assert hs.delete_target([5, 7, 9], HAND, 10) == {"del_cursors": [7]}  # 3 already masked
    assert hs.plan_target([3, 5, 7, 9], HAND, 6) == {"plan": [{"cursor": 3, "readers": [8]},
                                                            {"cursor": 5, "readers": [6, 10]}]}
    assert hs.plan_target([5, 9], HAND, 10) == {"plan": [{"cursor": 5, "readers": [10]},
                                                        {"cursor": 9, "readers": [10]}]}


def test_boundaries_every_k():
    assert hs.boundaries(HAND, 1) == [4, 6, 8, 10]
    assert hs.boundaries(HAND, 2) == [6, 10]
    assert hs.boundaries(HAND, 4) == [10]
    ends_with_tool = hand_trace("suat", {})
    assert hs.boundaries(ends_with_tool, 1) == []  # nothing follows the last tool message
    with pytest.raises(ValueError, match="every"):
        hs.boundaries(HAND, 0)


def test_aux_context_masks_only_expired_and_removes_them():
    ctx = hs.aux_context(HAND, 10, random.Random(0), mask_prob=1.0)
    assert ctx.masked == [3, 7]
    assert ctx.open_cursors == [5, 9]
    assert [m["content"] for m in ctx.messages if m["role"] == "tool"] == [cursor_content(5, "body 5"),
                                                                           cursor_content(9, "body 9")]
    assert len(ctx.messages) == 8  # 10 messages minus the two removed tool responses
    none = hs.aux_context(HAND, 10, random.Random(0), mask_prob=0.0)
    assert none.masked == [] and none.open_cursors == [3, 5, 7, 9]


def test_trace_validate_rejects_bad_provenance():
    with pytest.raises(ValueError, match="not an earlier tool message"):
        hand_trace("suata", {4: [4]})
    with pytest.raises(ValueError, match="not an earlier tool message"):
        hand_trace("suata", {4: [2]})


def _check_all_boundaries(trace: Trace, every: int, mask_prob: float, seed: int) -> None:
    last = trace.last_use()
    for b in hs.boundaries(trace, every):
        ctx = hs.aux_context(trace, b, random.Random(seed + b), mask_prob)
        target = hs.delete_target(ctx.open_cursors, trace, b)["del_cursors"]
        later_used = {c for s, cs in trace.reads.items() if s >= b for c in cs}
        assert not set(target) & later_used, "a target deletes a cursor a later step uses"
        assert set(target) <= set(ctx.open_cursors)
        assert {c for c in ctx.open_cursors if last[c] < b} == set(target), "an expired open cursor is not marked"
        assert not set(ctx.masked) & later_used, "pre-masking removed a cursor a later step uses"
        # The stats re-check (independent code path) agrees on the rendered row.
        trigger = hs.delete_trigger(ctx.open_cursors)
        assert not delete_row_errors(hs.with_trigger(ctx, trigger, {"del_cursors": target}), b, last)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), every=st.integers(1, 5), mask_prob=st.floats(0, 1),
       detour=st.floats(0, 1), recap=st.floats(0, 1))
def test_property_generated_traces_never_delete_a_cursor_used_later(seed, every, mask_prob, detour, recap):
    cfg = TraceConfig(world_size=60, detour_rate=detour, recap_rate=recap, page_words=40, doc_words=80)
    for t in generate_traces(3, seed, cfg):
        _check_all_boundaries(t, every, mask_prob, seed)


@st.composite
def random_traces(draw):
    n = draw(st.integers(3, 30))
    roles = "su" + "".join(draw(st.sampled_from(["a", "t", "ta", "at"])) for _ in range(n))
    cursors: list[int] = []
    reads = {}
    for i, r in enumerate(roles):
        if r == "a" and cursors:
            reads[i] = sorted(set(draw(st.lists(st.sampled_from(cursors), max_size=3))))
        if r == "t":
            cursors.append(i)
    return hand_trace(roles, {s: c for s, c in reads.items() if c})


@settings(max_examples=100, deadline=None)
@given(trace=random_traces(), every=st.integers(1, 4), mask_prob=st.floats(0, 1), seed=st.integers(0, 99))
def test_property_random_reads_never_delete_a_cursor_used_later(trace, every, mask_prob, seed):
    _check_all_boundaries(trace, every, mask_prob, seed)


def test_independent_check_catches_wrong_labels():
    last = HAND.last_use()
    ctx = hs.aux_context(HAND, 10, random.Random(0), mask_prob=0.0)
    trigger = hs.delete_trigger(ctx.open_cursors)
    harmful = hs.with_trigger(ctx, trigger, {"del_cursors": [3, 5, 7]})  # 5 is read at step 10
    assert delete_row_errors(harmful, 10, last)["harmful"] == 1
    missed = hs.with_trigger(ctx, trigger, {"del_cursors": [3]})  # 7 expired, not marked
    assert delete_row_errors(missed, 10, last)["missed"] == 1
    ctx2 = hs.aux_context(HAND, 10, random.Random(0), mask_prob=1.0)
    trigger2 = hs.delete_trigger(ctx2.open_cursors)
    invalid = hs.with_trigger(ctx2, trigger2, {"del_cursors": [3]})  # 3 was masked: not open
    assert delete_row_errors(invalid, 10, last)["invalid"] == 1
    stale = hs.with_trigger(ctx2, trigger, {"del_cursors": []})  # lists cursors the context no longer holds
    assert delete_row_errors(stale, 10, last)["format"] == 1
    bare = hs.with_trigger(ctx, hs.DELETE_TRIGGER, {"del_cursors": [3]})  # no cursor list
    assert delete_row_errors(bare, 10, last)["format"] == 1


def test_delete_trigger_lists_the_open_cursors_in_order():
    assert hs.delete_trigger([9, 3, 5]) == "Memory management mode\nOpen cursors: 3, 5, 9"
    assert hs.delete_trigger([]) == "Memory management mode\nOpen cursors: none"


# The three things a reader of the context can see that make a read response still needed. Written from the
# generator's visible text, not from its provenance, so the test fails if a label ever depends on something the
# manager cannot see (then no model could learn it, and the training target would be ill-posed).
_STATEMENTS = tuple(f"The {w} of " for w in FIELD_WORDS.values())


def _visibly_needed(msgs: list[dict]) -> set[int]:
    question = next(m["content"] for m in msgs if m["role"] == "user")
    keep = set(hs.unread_cursors(msgs))  # not read yet: the next step reads it
    for c, m in enumerate(msgs[:-1]):
        if m["role"] != "tool":
            continue
        reader = msgs[c + 1]["content"]
        if RECAP_REQUEST.strip() in question and reader.startswith(_STATEMENTS):
            keep.add(c)  # a fact page, and the user asked for every fact to be restated at the end
        if "Now the other side of the comparison" in reader:
            keep.add(c)  # the first branch's result, which the comparison's answer needs
    if len(msgs) >= 3 and "looks relevant; opening it." in msgs[-2]["content"]:
        keep.add(len(msgs) - 3)  # a detour into a wrong result: the agent goes back to this result list
    return keep


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), detour=st.floats(0, 1), recap=st.floats(0, 1), compare=st.floats(0, 1),
       twins=st.floats(0, 1))
def test_property_deletion_labels_are_decidable_from_the_visible_context(seed, detour, recap, compare, twins):
    cfg = TraceConfig(world_size=60, detour_rate=detour, recap_rate=recap, compare_rate=compare, twin_rate=twins,
                      page_words=40, doc_words=80)
    for t in generate_traces(4, seed, cfg):
        for b in hs.boundaries(t, 1):
            open_c = [c for c in t.cursors() if c < b]
            assert set(hs.expired(t, b)) == set(open_c) - _visibly_needed(t.messages[:b]), (t.task_id, b)


def test_notes_trigger_hand_worked():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Who founded X?"},
            {"role": "assistant", "content": "Searching.\n<tool_call>\n{}\n</tool_call>"},
            {"role": "tool", "content": "[cursor 3] search: ..."},
            {"role": "assistant", "content": "Result 1, X (d1), looks relevant;   opening it.\n<tool_call>{}"},
            {"role": "tool", "content": "[cursor 5] open(d1): ..."}]
    assert hs.delete_trigger([5, 3], msgs, "notes") == (
        "Memory management mode\nTask: Who founded X?\nOpen cursors: 3, 5\n"
        "3: Result 1, X (d1), looks relevant; opening it.\n5: not read yet")
    assert hs.delete_trigger([5, 3], msgs) == hs.delete_trigger([5, 3], msgs, "ids") == \
        "Memory management mode\nOpen cursors: 3, 5"
    long = msgs[:4] + [{"role": "assistant", "content": " ".join(f"w{i}" for i in range(30))}]
    assert hs.cursor_notes(long, [3])[3] == " ".join(f"w{i}" for i in range(hs.NOTE_WORDS))
    parallel = msgs[:4] + [{"role": "tool", "content": "[cursor 4] ..."}, {"role": "assistant", "content": "Both."}]
    assert hs.cursor_notes(parallel, [3, 4]) == {3: "Both.", 4: "Both."}  # one turn's responses share its reader
    with pytest.raises(ValueError, match="needs the context's messages"):
        hs.delete_trigger([3], None, "notes")
    with pytest.raises(ValueError, match="trigger style must be one of ids, notes"):
        hs.delete_trigger([3], msgs, "prose")


def _needed_by_the_notes_trigger(trigger: str) -> set[int]:
    """`_visibly_needed`, reading the notes trigger alone: the task line and each open cursor's note line."""
    lines = trigger.split("\n")
    task = lines[1]
    notes = {int(c): n for c, n in (line.split(": ", 1) for line in lines[3:])}
    read = [c for c, n in notes.items() if n != "not read yet"]
    keep = set(notes) - set(read)
    for c in read:
        if RECAP_REQUEST.strip() in task and notes[c].startswith(_STATEMENTS):
            keep.add(c)
        if "Now the other side of the comparison" in notes[c]:
            keep.add(c)
    if read and "looks relevant; opening it." in notes[max(read)]:
        keep.add(max(read))  # the newest read response: the step that opened the result after it wrote that note
    return keep


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), detour=st.floats(0, 1), recap=st.floats(0, 1), compare=st.floats(0, 1),
       twins=st.floats(0, 1))
def test_property_the_notes_trigger_alone_decides_every_label(seed, detour, recap, compare, twins):
    """With nothing pre-masked, the deletion label of every open cursor follows from the notes trigger's own text:
    the evidence sits beside each id, and no note is cut before its cue (`NOTE_WORDS`)."""
    cfg = TraceConfig(world_size=60, detour_rate=detour, recap_rate=recap, compare_rate=compare, twin_rate=twins,
                      page_words=40, doc_words=80)
    for t in generate_traces(4, seed, cfg):
        for b in hs.boundaries(t, 1):
            open_c = [c for c in t.cursors() if c < b]
            trigger = hs.delete_trigger(open_c, t.messages[:b], "notes")
            assert set(hs.expired(t, b)) == set(open_c) - _needed_by_the_notes_trigger(trigger), (t.task_id, b)
