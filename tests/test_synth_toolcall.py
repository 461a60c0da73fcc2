"""Tool-call format: round trip through the SmolLM2 chat template, and OpenAI JSONL import / export."""

import json
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from kvsteward.synth.chat import message_token_ids
from kvsteward.synth.traces.generate import generate_traces
from kvsteward.synth.traces.importer import (
    label_traces,
    openai_to_messages,
    read_openai_jsonl,
    trace_to_openai,
    write_openai_jsonl,
)
from kvsteward.synth.traces.planner import next_step_reads
from kvsteward.synth.traces.solver import TraceConfig
from kvsteward.synth.traces.toolcall import cursor_id, parse_tool_calls, render_assistant, template_supports_tools

OPENAI_SESSION = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": [{"type": "text", "text": "Find the capital."}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"query\": \"Ruritania\"}"}},
        {"id": "c2", "type": "function",
         "function": {"name": "open", "arguments": "{\"doc_id\": \"d7\", \"page\": 2}"}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "1. d7 | Ruritania | country"},
    {"role": "tool", "tool_call_id": "c2", "content": "Ruritania's capital is Strelsau. Quotes \"inside\" {braces}."},
    {"role": "assistant", "content": "The capital is Strelsau.\nFinal answer: Strelsau"},
]


def _split_rendered(text: str) -> list[tuple[str, str]]:
    """Parse a ChatML rendering back into (role, content) pairs."""
    return re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", text, re.S)


def test_smollm2_template_has_no_native_tools(tok):
    assert not template_supports_tools(tok)


def test_chat_template_round_trips_tool_calls(tok):
    msgs = openai_to_messages(OPENAI_SESSION)
    assert len(msgs) == len(OPENAI_SESSION)
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    # The per-message token pieces the engine appends decode to the same text.
    assert tok.decode([t for p in message_token_ids(tok, msgs) for t in p]) == rendered
    parsed = _split_rendered(rendered)
    assert [r for r, _ in parsed] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    text, calls = parse_tool_calls(parsed[2][1])
    assert text == ""
    assert calls == [{"name": "search", "arguments": {"query": "Ruritania"}},
                     {"name": "open", "arguments": {"doc_id": "d7", "page": 2}}]
    assert cursor_id(parsed[3][1]) == 3 and cursor_id(parsed[4][1]) == 4
    assert parsed[4][1].endswith('Quotes "inside" {braces}.')
    assert parse_tool_calls(parsed[5][1]) == ("The capital is Strelsau.\nFinal answer: Strelsau", [])


def test_generated_traces_round_trip_through_template(tok):
    t = generate_traces(1, 4, TraceConfig(world_size=100))[0]
    rendered = tok.apply_chat_template(t.messages, tokenize=False)
    parsed = _split_rendered(rendered)
    assert len(parsed) == len(t.messages)
    for (role, content), m in zip(parsed, t.messages, strict=True):
        assert role == m["role"]
        assert parse_tool_calls(content) == parse_tool_calls(m["content"])


def test_export_import_round_trip(tmp_path):
    traces = generate_traces(4, 9, TraceConfig(world_size=100))
    path = write_openai_jsonl(traces, tmp_path / "s.jsonl")
    first = json.loads(path.read_text().splitlines()[0])
    assert any("tool_calls" in m for m in first["messages"])
    assert all(not m["content"].startswith("[cursor") for m in first["messages"] if m["role"] == "tool")
    back = read_openai_jsonl(path)
    assert [b.messages for b in back] == [t.messages for t in traces]
    assert [b.task_id for b in back] == [t.task_id for t in traces]
    assert all(b.label_source == "unlabeled" and b.reads == {} for b in back)
    assert trace_to_openai(back[0]) == first["messages"]


def test_import_labels_and_records_source(tmp_path):
    (tmp_path / "one.jsonl").write_text(json.dumps({"id": "u1", "messages": OPENAI_SESSION}) + "\n")
    raw = read_openai_jsonl(tmp_path / "one.jsonl")
    assert raw[0].task_id == "u1"
    labelled = label_traces(raw, lambda t: {5: [3, 4]}, "stub", next_step_prior=True)
    assert labelled[0].reads == {5: [3, 4]}
    assert labelled[0].label_source == "planner:stub+next_step"
    assert next_step_reads(labelled[0]) == {5: [4]}


def test_bad_import_input_is_named(tmp_path):
    bad_role = [{"role": "robot", "content": "x"}]
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        openai_to_messages(bad_role)
    bad_args = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(ValueError, match="arguments is not valid JSON"):
        openai_to_messages(bad_args)
    p = tmp_path / "x.jsonl"
    p.write_text("{oops\n")
    with pytest.raises(ValueError, match=r"x.jsonl:1: not JSON"):
        read_openai_jsonl(p)
    with pytest.raises(ValueError, match="malformed tool call"):
        parse_tool_calls(render_assistant("t", []) + "<tool_call>{bad}</tool_call>")
