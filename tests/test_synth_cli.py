"""The `steward synth` / `steward plan` contract, end to end on a small run."""

import json
import os
from collections import Counter

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from typer.testing import CliRunner

from kvsteward.pipelines.cli import app

runner = CliRunner()
KEYS = {"splits", "aux_delete", "aux_plan", "main", "mean_tokens", "max_tokens", "mean_cursors", "label_errors"}


def _ok(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "traces"
    out = json.loads(_ok(["synth", "traces", "--tasks", "10", "--seed", "3", "--out", str(d), "--world-size", "200",
                          "--json"]))
    assert out["traces"] == 10 and out["splits"] == {"train": 8, "validation": 1, "test": 1}
    return d


def test_traces_hindsight_stats_contract(traces_dir, tmp_path):
    _ok(["synth", "hindsight", str(traces_dir), "--every", "4", "--out", str(tmp_path / "ds")])
    stats = json.loads(_ok(["synth", "stats", str(tmp_path / "ds"), "--json"]))
    assert KEYS <= set(stats)
    assert stats["label_errors"] == 0 and stats["main"] == 10 and stats["aux_delete"] > 0
    assert stats["max_tokens"] <= 4096 and isinstance(stats["mean_tokens"], float)
    assert sum(stats["splits"].values()) == stats["main"] + stats["aux_delete"] + stats["aux_plan"]


def test_packed_hindsight_stats(traces_dir, tmp_path):
    card = json.loads(_ok(["synth", "hindsight", str(traces_dir), "--every", "2", "--pack", "--max-tokens", "100000",
                           "--out", str(tmp_path / "ds"), "--json"]))
    from kvsteward.synth.traces.hindsight import boundaries
    from kvsteward.synth.traces.trace import read_traces

    with_calls = Counter(t.split for t in read_traces(traces_dir) if boundaries(t, 2))  # one packed row each
    assert {s: r.get("packed", 0) for s, r in card["rows"].items()} == {s: with_calls[s] for s in card["rows"]}
    assert all(set(r) <= {"packed"} for r in card["rows"].values()) and sum(with_calls.values()) >= 5
    assert card["label_balance"]["delete_rows"] == sum(c.get("delete", 0) for c in card["packed_calls"].values())
    assert sum(c.get("plan", 0) for c in card["packed_calls"].values()) == card["label_balance"]["delete_rows"]
    stats = json.loads(_ok(["synth", "stats", str(tmp_path / "ds"), "--json"]))
    assert stats["packed"] == sum(with_calls.values()) and stats["label_errors"] == 0 and stats["main"] == 0


def test_export_import_with_lexical_planner(traces_dir, tmp_path):
    _ok(["synth", "export", str(traces_dir), "--out", str(tmp_path / "s.jsonl")])
    _ok(["synth", "import", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "imp"), "--planner", "lexical"])
    _ok(["synth", "hindsight", str(tmp_path / "imp"), "--every", "2", "--out", str(tmp_path / "ds")])
    card = json.loads((tmp_path / "ds" / "card.json").read_text())
    assert card["label_sources"] == {"planner:lexical+next_step": 10}
    assert json.loads(_ok(["synth", "stats", str(tmp_path / "ds"), "--json", "--no-check-tokens"]))[
        "label_errors"] == 0


def test_bad_input_gives_a_clear_error(tmp_path):
    r = runner.invoke(app, ["synth", "traces", "--env", "templated", "--tasks", "2", "--out", str(tmp_path / "x"),
                            "--min-hops", "1"])
    assert r.exit_code == 2 and "min_hops" in r.output
    r = runner.invoke(app, ["synth", "traces", "--env", "ops", "--tasks", "2", "--out", str(tmp_path / "x"),
                            "--page-words", "20"])  # a flag the chosen environment does not have: refused, not ignored
    assert r.exit_code == 2 and "--page-words: no environment among ops" in r.output
    r = runner.invoke(app, ["synth", "traces", "--env", "ops", "--tasks", "2", "--out", str(tmp_path / "x"),
                            "-o", "nonsense=3"])
    assert r.exit_code == 2 and "--option nonsense" in r.output
    r = runner.invoke(app, ["synth", "stats", str(tmp_path / "nope"), "--json"])
    assert r.exit_code == 2 and "not a saved DatasetDict" in r.output
    r = runner.invoke(app, ["synth", "import", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "y"),
                            "--planner", "lexical"])
    assert r.exit_code == 2 and "does not exist" in r.output


@pytest.mark.slow
def test_plan_extract_contract(traces_dir):
    out = json.loads(_ok(["plan", "extract", "--model", "smollm2", "--sessions", str(traces_dir), "--limit", "1",
                          "--json"]))
    assert {"edge_recall", "edge_precision", "n_sessions"} <= set(out) and out["n_sessions"] == 1
    assert 0 <= out["edge_recall"] <= 1 and out["baselines"]["next_step"]["edge_precision"] == 1.0
