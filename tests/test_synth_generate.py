"""World, tasks and the scripted solver: determinism, split disjointness, correctness of answers and provenance."""

import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.solver import TraceConfig
from kvsteward.synth.traces.tasks import check_answer
from kvsteward.synth.traces.toolcall import cursor_body, parse_tool_calls
from kvsteward.synth.traces.trace import read_traces, write_traces
from kvsteward.synth.traces.world import build_worlds

SMALL = TraceConfig(world_size=300)


@pytest.fixture(scope="module")
def traces():
    return generate_traces(30, 11, SMALL)


def test_determinism_by_seed(tmp_path, traces):
    again = generate_traces(30, 11, SMALL)
    assert [t.to_json() for t in again] == [t.to_json() for t in traces]
    write_traces(tmp_path / "a", traces, {})
    assert [t.to_json() for t in read_traces(tmp_path / "a")] == [t.to_json() for t in traces]
    other = generate_traces(30, 12, SMALL)
    assert [t.to_json() for t in other] != [t.to_json() for t in traces]


def test_split_disjointness(traces):
    by = {s: [t for t in traces if t.split == s] for s in ("train", "validation", "test")}
    assert all(by.values()), "every split gets tasks"
    for a in by:
        for b in by:
            if a < b:
                assert not {t.task_id for t in by[a]} & {t.task_id for t in by[b]}
                assert not {d for t in by[a] for d in t.docs} & {d for t in by[b] for d in t.docs}
                assert not {e for t in by[a] for e in t.entities} & {e for t in by[b] for e in t.entities}
                assert not {t.task_seed for t in by[a]} & {t.task_seed for t in by[b]}


def test_worlds_share_no_entity_name():
    worlds = build_worlds(5, world_size=500)
    names = [{e.name for e in w.entities.values()} for w in worlds.values()]
    assert sum(map(len, names)) == len(set().union(*names))
    assert all(len(w.entities) >= 500 for w in worlds.values())


def test_answers_are_correct_and_provenance_points_at_facts(traces):
    checked = 0
    for t in traces:
        assert 2 <= t.hops <= 6
        final = t.messages[-1]["content"]
        assert check_answer(t.answer, final), (t.task_id, final[-80:])
        # Every statement "The <field> of <X> is <V>." in a step must be backed by a cursor that step reads.
        for step, cs in t.reads.items():
            text = parse_tool_calls(t.messages[step]["content"])[0]
            read_text = " ".join(cursor_body(t.messages[c]["content"]) for c in cs)
            for value in re.findall(r"\b[Tt]he [a-z ]+ of [^.,\n]+? is ([^.,\n]+)", text):
                assert value in read_text, (t.task_id, step, value)
                checked += 1
    assert checked > len(traces)


def test_every_cursor_is_read_by_the_next_step_and_detours_expire(traces):
    early = 0
    for t in traces:
        for c in t.cursors():
            if c + 1 < len(t.messages):
                assert c in t.reads.get(c + 1, []), "the step after a tool response reacts to it"
        last = t.last_use()
        early += sum(1 for c, lu in last.items() if lu == c + 1)
        assert len(t.messages) >= 10
    assert early > 0


def test_tool_calls_parse_and_replay(traces):
    worlds = build_worlds(11, world_size=300)
    t = traces[0]
    w = worlds[t.split]
    for i, m in enumerate(t.messages[:-1]):
        if m["role"] == "assistant":
            _, calls = parse_tool_calls(m["content"])
            assert len(calls) == 1 and t.messages[i + 1]["role"] == "tool"
            if calls[0]["name"] == "open":
                doc = w.document(calls[0]["arguments"]["doc_id"])
                assert doc.title in t.messages[i + 1]["content"]


def test_search_ranks_near_duplicates_with_the_original():
    w = build_worlds(2, world_size=400)["train"]
    twin = next(e for e in w.entities.values() if e.twin_of)
    hits = [h.doc_id for h in w.search(w.name(twin.twin_of))]
    assert twin.doc_id in hits[:2] and twin.twin_of in hits[:2]
    assert [h.doc_id for h in w.search(f'"{twin.name}"')] == [twin.doc_id]


def test_length_knobs_scale_turns_and_tokens():
    short = generate_traces(6, 1, TraceConfig(world_size=200, min_hops=2, max_hops=2, detour_rate=0))
    long = generate_traces(6, 1, TraceConfig(world_size=200, min_hops=6, max_hops=6, page_words=40, doc_words=400,
                                              detour_rate=1))
    n_short = sum(len(t.messages) for t in short) / 6
    n_long = sum(len(t.messages) for t in long) / 6
    assert n_short < 16 and n_long > 60


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="hops"):
        generate_traces(2, 0, TraceConfig(min_hops=1))
    with pytest.raises(ValueError, match="detour_rate"):
        generate_traces(2, 0, TraceConfig(detour_rate=2))
    with pytest.raises(ValueError, match="tasks"):
        generate_traces(0, 0)
