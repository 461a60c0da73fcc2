"""Long coding sessions as a second trace source: same generator, exact provenance, hindsight labels, splits."""

from __future__ import annotations

import json
import os
import random
import re
import sysconfig
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from typer.testing import CliRunner

from kvsteward.pipelines.cli import app
from kvsteward.synth.longsession.generate import generate_sessions
from kvsteward.synth.longsession.traces import (
    TOOL_NAME,
    filler_chunk,
    longsession_traces,
    session_to_trace,
    split_of_seed,
)
from kvsteward.synth.traces import hindsight as hs
from kvsteward.synth.traces.toolcall import cursor_body, cursor_id, parse_tool_calls

LENGTH, DISTANCES, CHUNK = 3000, [300, 1500], 300
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def sessions(tok):
    return generate_sessions(tok, 2, LENGTH, DISTANCES, seed=5, chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def traces(sessions):
    return [session_to_trace(s, split_of_seed(s.seed)) for s in sessions]


def _session_code(content: str) -> str:
    """The fenced code of a session filler message (independent of the module's template regexes)."""
    return content.split("```python\n", 1)[1].rsplit("\n```", 1)[0]


def _defs(s) -> set[int]:
    return {i for step in s.definition_steps for i in step}


def test_trace_validates_and_cursor_ids_are_message_indices(traces):
    for t in traces:
        t.validate()
        assert t.cursors(), "a 3000-token session with 300-token chunks has filler cursors"
        for i, m in enumerate(t.messages):
            if m["role"] == "tool":
                assert cursor_id(m["content"]) == i
                assert cursor_body(m["content"]).startswith(f"{TOOL_NAME}(")
        assert t.label_source == "oracle" and t.kind == "longsession"


def test_same_content_as_the_session(sessions, traces):
    """Filler code (in order), definitions and probe questions come over verbatim; each call names its stdlib file."""
    for s, t in zip(sessions, traces, strict=True):
        fill = [_session_code(m.content) for i, m in enumerate(s.messages)
                if i > 0 and i not in _defs(s) and m.role == "user"]
        bodies = [cursor_body(t.messages[c]["content"]).split("\n", 1)[1] for c in t.cursors()]
        assert bodies == fill
        for c in t.cursors():
            _, calls = parse_tool_calls(t.messages[c - 1]["content"])
            assert len(calls) == 1 and calls[0]["name"] == TOOL_NAME
            a = calls[0]["arguments"]
            src = (STDLIB / a["path"]).read_text(encoding="utf-8").splitlines()
            assert "\n".join(src[a["start_line"] - 1:a["end_line"]]) == cursor_body(t.messages[c]["content"]).split(
                "\n", 1)[1]
        def_msgs = [s.messages[i].model_dump() for i in sorted(_defs(s))]
        assert [m for m in t.messages if m in def_msgs] == def_msgs
        questions = [m["content"] for m in t.messages if m["role"] == "user"]
        for p in s.probes:
            assert (p.messages[0].content in questions) == (p.kind == "fact")


def test_every_filler_cursor_is_read_exactly_by_the_next_step(traces):
    """Documented provenance: cursor c's only reader is step c + 1, which names facts (def/class names) from it."""
    for t in traces:
        readers = t.readers()
        for c in t.cursors():
            assert readers[c] == [c + 1]
            assert t.last_use()[c] == c + 1
            ack = t.messages[c + 1]
            assert ack["role"] == "assistant"
            text, _ = parse_tool_calls(ack["content"])
            said = text.split(". ")[0]
            for name in re.findall(r"`(\w+)`", said.split(" define ", 1)[1]):
                assert re.search(rf"^\s*(async\s+def|def|class)\s+{name}\b", t.messages[c]["content"], re.M)
        non_filler = [s for s, cs in t.reads.items() if cs and t.messages[s - 1]["role"] != "tool"]
        assert non_filler == []


def test_delete_targets_are_exactly_the_expired_filler_cursors(traces):
    """At boundary b (right after cursor b-1) every earlier open cursor is expired, b-1 itself is read at b."""
    for t in traces:
        bounds = hs.boundaries(t, 1)
        assert bounds == [c + 1 for c in t.cursors()]
        for b in bounds:
            for prob in (0.0, 0.5):
                ctx = hs.aux_context(t, b, random.Random(b), prob)
                want = [c for c in t.cursors() if c < b - 1 and c not in ctx.masked]
                assert hs.delete_target(ctx.open_cursors, t, b) == {"del_cursors": want}
                assert hs.plan_target(ctx.open_cursors, t, b) == {"plan": [{"cursor": b - 1, "readers": [b]}]}


def test_final_answer_is_the_first_fact_probe(sessions, traces):
    for s, t in zip(sessions, traces, strict=True):
        first = next(p for p in s.probes if p.kind == "fact")
        assert t.answer == first.gold.strip() and t.question == first.messages[0].content
        assert t.messages[-2] == {"role": "user", "content": first.messages[0].content}
        assert t.messages[-1]["content"].endswith(f"\nFinal answer: {first.gold.strip()}")
        for i, m in enumerate(t.messages[:-1]):  # the other fact answers: the exact definition line
            p = next((p for p in s.probes if p.messages[0].content == m["content"]), None)
            if p is not None and p is not first:
                assert t.messages[i + 1]["content"].startswith(p.answer_prefix + p.gold)
                assert t.messages[i + 1]["content"] in s.messages[s.definition_steps[1][0]].content + \
                    s.messages[s.definition_steps[2][0]].content


def test_deterministic_by_seed_and_same_as_generate_sessions(tok):
    a = longsession_traces(tok, 2, LENGTH, 7, [750], chunk_tokens=CHUNK)
    b = longsession_traces(tok, 2, LENGTH, 7, [750], chunk_tokens=CHUNK)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    ref = generate_sessions(tok, 2, LENGTH, [750], seed=7, chunk_tokens=CHUNK)
    assert [t.to_json() for t in a] == [session_to_trace(s, split_of_seed(s.seed)).to_json() for s in ref]
    c = longsession_traces(tok, 1, LENGTH, 8, [750], chunk_tokens=CHUNK)
    assert c[0].task_seed not in {t.task_seed for t in a} and c[0].messages != a[0].messages


def test_splits_are_a_function_of_the_seed(traces):
    by_seed: dict[int, set[str]] = {}
    for t in traces:  # two distances per seed: both traces share the seed, so they must share the split
        by_seed.setdefault(t.task_seed, set()).add(t.split)
    assert all(len(v) == 1 for v in by_seed.values()) and len(by_seed) == 2
    counts = Counter(split_of_seed(s) for s in range(5000))
    assert set(counts) == {"train", "validation", "test"}
    assert abs(counts["train"] / 5000 - 0.8) < 0.03 and abs(counts["test"] / 5000 - 0.1) < 0.02
    seeds = {sp: {s for s in range(5000) if split_of_seed(s) == sp} for sp in counts}
    assert not (seeds["train"] & seeds["test"]) and not (seeds["train"] & seeds["validation"])


def test_tampered_session_is_refused(sessions):
    s = sessions[0]
    i = next(i for i in range(1, len(s.messages)) if i not in _defs(s))
    bad = s.model_copy(deep=True)
    bad.messages[i].content = bad.messages[i].content.replace("\n", "\n# edited\n", 1)
    with pytest.raises(ValueError, match="filler turn"):
        filler_chunk(bad, i)
    with pytest.raises(ValueError, match="no fact probe 'fact:nope'"):
        session_to_trace(s, "train", final_probe="fact:nope")
    with pytest.raises(ValueError, match="split must be"):
        session_to_trace(s, "dev")


def test_cli_traces_hindsight_stats_have_no_label_errors(tmp_path):
    runner = CliRunner()

    def ok(args):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        return r.stdout

    tr, ds = tmp_path / "tr", tmp_path / "ds"
    out = json.loads(ok(["synth", "traces", "--source", "longsession", "--length", str(LENGTH), "--tasks", "3",
                         "--seed", "3", "--chunk-tokens", str(CHUNK), "--out", str(tr), "--json"]))
    assert out["traces"] == 3 and out["mean_cursors"] > 2
    assert json.loads((tr / "meta.json").read_text())["source"] == "longsession"
    ok(["synth", "hindsight", str(tr), "--every", "2", "--out", str(ds)])
    stats = json.loads(ok(["synth", "stats", str(ds), "--json"]))
    assert stats["label_errors"] == 0 and stats["main"] == 3 and stats["aux_delete"] > 0
    r = runner.invoke(app, ["synth", "traces", "--source", "nope", "--tasks", "1", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "unknown environment" in r.output and "nope" in r.output
