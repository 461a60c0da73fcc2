"""Traces of any origin hand their exact labels over in OpenAI JSONL: `export --provenance` → `import --planner
provenance` gives back the same trace (messages, reads, cues, answer, env), and bad provenance is refused by name."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvsteward.pipelines.cli import app
from kvsteward.synth.traces.envs import generate
from kvsteward.synth.traces.trace import read_traces, write_traces

runner = CliRunner()


def _ok(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return r


def test_export_import_round_trip_keeps_the_exact_labels(tmp_path):
    traces = generate("templated", 6, 3)
    for t in traces:  # a cue per cursor, as the agent environments write them
        t.cues = {c: f"cue{c % 3}" for c in t.cursors()}
    write_traces(tmp_path / "t", traces, {})
    _ok(["synth", "export", str(tmp_path / "t"), "--provenance", "--out", str(tmp_path / "s.jsonl")])
    line = json.loads((tmp_path / "s.jsonl").read_text().splitlines()[0])
    assert {"reads", "env", "answer", "cues", "messages"} <= set(line)
    assert "tool_calls" in next(m for m in line["messages"] if m["role"] == "assistant")  # the OpenAI shape
    _ok(["synth", "import", str(tmp_path / "s.jsonl"), "--planner", "provenance", "--out", str(tmp_path / "i")])
    back = {t.task_id: t for t in read_traces(tmp_path / "i")}
    for t in traces:
        b = back[t.task_id]
        assert b.messages == t.messages and b.reads == {k: v for k, v in t.reads.items()}
        assert b.cues == t.cues and b.answer == t.answer and b.env == t.env == "templated"
        assert b.label_source == "provenance"


def test_import_refuses_missing_or_bad_provenance(tmp_path):
    traces = generate("templated", 2, 3)
    write_traces(tmp_path / "t", traces, {})
    _ok(["synth", "export", str(tmp_path / "t"), "--provenance", "--out", str(tmp_path / "s.jsonl")])
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    plain = json.loads(lines[1])
    del plain["reads"]
    (tmp_path / "mixed.jsonl").write_text(lines[0] + "\n" + json.dumps(plain) + "\n")
    r = runner.invoke(app, ["synth", "import", str(tmp_path / "mixed.jsonl"), "--planner", "provenance", "--out",
                            str(tmp_path / "x")])
    assert r.exit_code == 2 and "without a \"reads\" field" in r.output
    bad = json.loads(lines[0])
    step = max(int(k) for k in bad["reads"])
    bad["reads"][str(step)] = [step + 1]  # a step reading a later message
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    r = runner.invoke(app, ["synth", "import", str(tmp_path / "bad.jsonl"), "--planner", "provenance", "--out",
                            str(tmp_path / "y")])
    assert r.exit_code == 2 and "not an earlier tool message" in r.output
    bad["reads"] = {"3": "five"}
    (tmp_path / "bad2.jsonl").write_text(json.dumps(bad) + "\n")
    r = runner.invoke(app, ["synth", "import", str(tmp_path / "bad2.jsonl"), "--planner", "provenance", "--out",
                            str(tmp_path / "z")])
    assert r.exit_code == 2 and "list of message indices" in r.output
