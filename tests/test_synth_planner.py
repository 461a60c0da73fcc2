"""Planners and their metrics, against hand-worked numbers and stub models."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from kvsteward.synth.traces import planner as pl
from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.solver import TraceConfig
from kvsteward.synth.traces.toolcall import cursor_content
from kvsteward.synth.traces.trace import Trace


def _trace(reads):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Who founded Veltria Systems?"},
            {"role": "assistant", "content": "Searching for Veltria Systems."},
            {"role": "tool",
             "content": cursor_content(3, "1. d17 | Veltria Systems | company\n2. d18 | Veltrea Works")},
            {"role": "assistant", "content": "Result 1 is Veltria Systems (d17); opening it."},
            {"role": "tool", "content": cursor_content(5, "Veltria Systems was founded by Ada Quorn in 1901.")},
            {"role": "assistant", "content": "The founder of Veltria Systems is Ada Quorn. Searching Ada Quorn."},
            {"role": "tool", "content": cursor_content(7, "1. d40 | Ada Quorn | person")},
            {"role": "assistant", "content": "Recap: Veltria Systems was founded by Ada Quorn. Ada Quorn is d40.\n"
                                                 "Final answer: Ada"}]
    t = Trace("p", "train", msgs, reads)
    t.validate()
    return t


ORACLE = _trace({4: [3], 6: [5], 8: [5, 7]})


def test_edge_metrics_hand_worked():
    pred = {4: [3], 6: [3], 8: [7]}  # (3,4) right, (3,6) wrong, (7,8) right; misses (5,6), (5,8)
    s = pl.score([ORACLE], [pred], every=1)
    assert s["edge_precision"] == pytest.approx(2 / 3)
    assert s["edge_recall"] == pytest.approx(2 / 4)
    assert s["far_edge_recall"] == pytest.approx(0.0)  # the one far edge (5, 8) is missed
    # Deletions with every=1 (boundaries 4, 6, 8): oracle expires 3 at 6 and 8; the prediction expires 5 at 6
    # and 3, 5 at 8 → predicted {(6,5),(8,3),(8,5)} vs oracle {(6,3),(8,3)}.
    assert pl.deletion_pairs(ORACLE, pred, 1) == {(6, 5), (8, 3), (8, 5)}
    assert pl.deletion_pairs(ORACLE, ORACLE.reads, 1) == {(6, 3), (8, 3)}
    assert s["delete_precision"] == pytest.approx(1 / 3) and s["delete_recall"] == pytest.approx(1 / 2)
    assert s["harmful_deletions"] == 2


def test_next_step_and_lexical_baselines():
    assert pl.next_step_reads(ORACLE) == {4: [3], 6: [5], 8: [7]}
    lex = pl.lexical_reads(ORACLE)
    assert lex[4] == [3]  # d17 and the name are in the search results
    assert lex[6] == [5]  # "Ada Quorn" only occurs in the page
    # One cursor per sentence (most rare strings shared, ties → most recent): the founder sentence → the page,
    # the d40 sentence → the last search.
    assert lex[8] == [5, 7]


def test_parse_cursor_ids_is_robust():
    assert pl.parse_cursor_ids(" 3, which is a", [3, 5]) == [3]
    assert pl.parse_cursor_ids("cursor 5 and [cursor 3]; 12", [3, 5]) == [3, 5]
    assert pl.parse_cursor_ids("none of them", [3, 5]) == []
    assert pl.parse_cursor_ids("", [3]) == []


def test_llm_planner_with_stub_models():
    traces = generate_traces(3, 2, TraceConfig(world_size=100))
    got = []
    for t in traces:  # a "model" that answers with the oracle's reads of the step named in the answer prefix
        def oracle_model(messages, prefix, t=t):
            return ", ".join(map(str, t.reads.get(int(prefix.split()[1]), [])))

        got.append(pl.LLMPlanner(oracle_model, max_cursors=100).reads(t)[0])
    s = pl.score(traces, got, every=2)
    assert s["edge_recall"] == 1.0 and s["edge_precision"] == 1.0 and s["delete_precision"] == 1.0
    junk = pl.LLMPlanner(lambda m, p: "I think it is the search.", max_cursors=4)
    reads, failures = junk.reads(traces[0])
    assert reads == {} and failures == len(pl.reader_steps(traces[0]))
    msgs, cands = pl.LLMPlanner(junk.complete, max_cursors=2).prompt(traces[0], pl.reader_steps(traces[0])[-1])
    assert len(cands) == 2 and all(f"[cursor {c}]" in msgs[1]["content"] for c in cands)


@pytest.mark.slow
def test_local_smollm2_planner_answers_one_step():
    t = generate_traces(1, 3, TraceConfig(world_size=100))[0]
    complete = pl.local_completer("smollm2", max_new_tokens=4)
    planner = pl.LLMPlanner(complete, max_cursors=2, cursor_chars=60)
    step = pl.reader_steps(t)[0]
    msgs, cands = planner.prompt(t, step)
    reply = complete(msgs, planner.answer_prefix(step))
    assert isinstance(reply, str) and len(reply) > 0


def test_union_of_reads():
    assert pl.union({4: [3]}, {4: [5], 6: [5]}, {8: []}) == {4: [3, 5], 6: [5]}
