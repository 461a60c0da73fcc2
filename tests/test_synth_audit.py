"""The shortcut audit: decisions from both sources agree, the baselines do what they say on hand-built cases,
delete_all_read matches a hand count, the text classifier is flagged on `templated`, and the CLI contract."""

import json
import os
import shutil

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
from datasets import load_from_disk
from typer.testing import CliRunner

from kvsteward.pipelines.cli import app
from kvsteward.synth.traces import audit as am
from kvsteward.synth.traces import baselines as bl
from kvsteward.synth.traces.decisions import Decision, decisions_at, decisions_from_split
from kvsteward.synth.traces.hindsight import boundaries, expired, unread_cursors
from kvsteward.synth.traces.trace import read_traces, write_traces

runner = CliRunner()
KEYS = {"f1", "precision", "recall", "harmful_rate", "harmful_rate_ci95", "deleted", "n_decisions", "setting"}


def _ok(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """150 templated traces and their hindsight dataset (`--every 2`, audit on by default)."""
    root = tmp_path_factory.mktemp("audit")
    _ok(["synth", "traces", "--env", "templated", "--tasks", "150", "--seed", "0", "--out", str(root / "tr")])
    _ok(["synth", "hindsight", str(root / "tr"), "--every", "2", "--no-plan", "--out", str(root / "ds")])
    return root / "tr", root / "ds"


@pytest.fixture(scope="module")
def decisions(made):
    dd = load_from_disk(str(made[1]))
    return decisions_from_split(dd["train"]), decisions_from_split(dd["validation"]), dd


def test_hindsight_audit_flags_the_text_classifier(made):
    card = json.loads((made[1] / "card.json").read_text())
    a = card["audit"]
    assert set(a["baselines"]) == set(bl.BASELINES) and all(KEYS <= set(m) for m in a["baselines"].values())
    assert a["baselines"]["text_classifier"]["f1"] >= 0.95
    assert any(f["baseline"] == "text_classifier" and f["message"] == am.FLAG_MESSAGE for f in a["flags"])
    assert a["oracle_f1"] == 1.0 and set(a["by_env"]) == {"templated"} and "by_cue" not in a  # templated: no cues
    assert "## Audit" in (made[1] / "README.md").read_text()
    assert set(bl.load_baselines(made[1] / am.BASELINES_DIR)) == set(bl.BASELINES)


def test_delete_all_read_equals_a_hand_count(made, decisions):
    """Every read open cursor of every validation row, labelled from the raw traces' reads by hand."""
    _, val, dd = decisions
    traces = {t.task_id: t for t in read_traces(made[0]) if t.split == "validation"}
    masked = {(r["task_id"], r["step"]): set(r["masked_cursors"]) for r in dd["validation"] if r["kind"] == "delete"}
    tp = fp = 0
    for (tid, b), gone in masked.items():
        msgs = traces[tid].messages
        last = {i: max([s for s, cs in traces[tid].reads.items() if i in cs], default=-1)
                for i, m in enumerate(msgs) if m["role"] == "tool"}
        trailing = b - 1
        while msgs[trailing - 1]["role"] == "tool":
            trailing -= 1
        for c in (c for c in last if c < trailing and c not in gone):
            tp, fp = tp + (last[c] < b), fp + (last[c] >= b)
    m = json.loads((made[1] / "card.json").read_text())["audit"]["baselines"]["delete_all_read"]
    assert (m["deleted"], m["n_decisions"], len(val)) == (tp + fp, tp + fp, tp + fp)
    assert m["precision"] == pytest.approx(tp / (tp + fp)) and m["recall"] == 1.0
    assert m["f1"] == pytest.approx(2 * tp / (2 * tp + fp)) and m["harmful_rate"] == pytest.approx(fp / (tp + fp))


def test_decisions_at_and_from_split_agree(made, decisions):
    _, val, _ = decisions
    traces = {t.task_id: t for t in read_traces(made[0])}
    groups: dict = {}
    for d in val:
        groups.setdefault((d.trace_id, d.boundary), []).append(d)
    assert len(groups) > 20 and any(d.recency > 0 for d in val)
    for (tid, b), got in groups.items():
        t = traces[tid]
        gone = set(expired(t, b))
        # open = the row's read open cursors and the unread responses at its end (never deleted before being read)
        open_cursors = [d.cursor for d in got] + unread_cursors(t.messages[:b])
        assert decisions_at(t.messages, open_cursors, b, gone.__contains__, tid, t.env, t.cues) == got
    assert all(d.env == "templated" and d.task == traces[d.trace_id].messages[1]["content"] for d in val)


def _d(cursor: int, recency: int, label: bool, tid: str = "t0", boundary: int = 20, body: str = "", task: str = ""):
    return Decision(tid, "x", boundary, cursor, label, "", task, body, "note", "call", recency + 1, recency)


def test_keep_last_k_on_a_hand_built_case():
    # at each of 4 boundaries the 3 most recent read cursors are still needed, the 2 older ones expired
    train = [_d(c, 4 - c, c < 2, f"t{i}") for i in range(4) for c in range(5)]
    b = bl.KeepLastK().fit(train)
    assert b.points["f1"]["setting"] == {"K": 3} and b.points["f1"]["train"]["f1"] == 1.0
    assert b.points["safe"]["setting"] == {"K": 3}  # no harmful deletion at K=3
    assert b.delete(train[:5]) == {0, 1} and b.delete([_d(7, 0, False)]) == set()
    train[0] = _d(0, 4, False)  # one old cursor still needed: K=3 now deletes it, harmfully (1 of 8: over 2 %)
    b = bl.KeepLastK().fit(train)
    # no K that deletes anything keeps harmful deletions under 2 %: the safe point deletes nothing (ties: the largest K)
    assert b.points["f1"]["setting"] == {"K": 3} and b.points["safe"]["setting"] == {"K": bl.MAX_K}
    assert bl.DeleteAllRead().fit(train).delete(train[:5]) == {0, 1, 2, 3, 4}


def test_lexical_overlap_on_a_hand_built_case():
    task = "Where was Orla Quint born in 1961?"
    train = [_d(3, 1, False, "a", body="Orla Quint (person) born 1961 in Bexton", task=task),
             _d(5, 0, True, "a", body="search results: weather tables", task=task),
             _d(3, 1, False, "b", body="Orla Quint met Tam Rivo", task="Who is Orla Quint?"),
             _d(5, 0, True, "b", body="Rivo Group annual report", task="Who is Orla Quint?")]
    b = bl.LexicalOverlap().fit(train)
    # 4 bodies: "orla" and "quint" in 2 (idf log(5/3)+1), "1961" / "bexton" / "tam" / "group" ... in 1 (log(5/2)+1)
    assert b.overlap(train[0]) == pytest.approx(2 * (np.log(5 / 3) + 1) + (np.log(5 / 2) + 1))
    assert b.overlap(train[1]) == 0.0 and b.overlap(train[2]) == pytest.approx(2 * (np.log(5 / 3) + 1))
    assert b.points["f1"]["train"]["f1"] == 1.0 and b.delete(train[:2]) == {5}
    assert 0 <= b.points["f1"]["setting"]["keep_if_overlap_above"] < 2 * (np.log(5 / 3) + 1)


def test_save_load_round_trip_gives_identical_scores(tmp_path, decisions):
    train, val, _ = decisions
    fitted = bl.fit_all(train)
    bl.save_baselines(fitted, tmp_path / "b")
    back = bl.load_baselines(tmp_path / "b")
    for n, b in fitted.items():
        assert np.array_equal(b.scores(val), back[n].scores(val)) and b.points == back[n].points
        assert b.delete(val[:6], "safe") == back[n].delete(val[:6], "safe")
    with pytest.raises(FileNotFoundError, match="no fitted baselines"):
        bl.load_baselines(tmp_path / "nothing")


def test_cli_contract(made, tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(made[1], ds)
    before = {p: (ds / p).read_bytes() for p in ("card.json", "README.md", "baselines/baselines.json")}
    out = json.loads(_ok(["synth", "audit", str(ds), "--json", "--no-write"]))
    assert {"baselines", "oracle_f1", "n_decisions", "by_env", "flags"} <= set(out)
    assert all(KEYS <= set(m) for m in out["baselines"].values())
    assert {p: (ds / p).read_bytes() for p in before} == before  # --no-write leaves everything alone
    card = json.loads((ds / "card.json").read_text())
    del card["audit"]
    (ds / "card.json").write_text(json.dumps(card))
    shutil.rmtree(ds / "baselines")
    text = _ok(["synth", "audit", str(ds)])
    assert "text_classifier" in text and "surface rule" in text
    written = json.loads((ds / "card.json").read_text())["audit"]
    assert {k: v for k, v in written.items() if k != "wall_s"} == {k: v for k, v in out.items() if k != "wall_s"}
    assert (ds / "baselines" / "baselines.json").is_file() and "## Audit" in (ds / "README.md").read_text()


def test_cli_errors(made, tmp_path):
    r = runner.invoke(app, ["synth", "audit", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "does not exist" in r.output
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["synth", "audit", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "not a saved DatasetDict" in r.output
    trs = [t for t in read_traces(made[0]) if boundaries(t, 2)]
    write_traces(tmp_path / "few", [t for t in trs if t.split == "train"][:3], {})
    _ok(["synth", "hindsight", str(tmp_path / "few"), "--every", "2", "--no-plan", "--out", str(tmp_path / "tr_only")])
    assert "audit" not in json.loads((tmp_path / "tr_only" / "card.json").read_text())  # skipped: no validation
    r = runner.invoke(app, ["synth", "audit", str(tmp_path / "tr_only")])
    assert r.exit_code == 2 and "validation split has no deletion decisions" in r.output
    _ok(["synth", "hindsight", str(tmp_path / "few"), "--every", "2", "--pack", "--max-tokens", "100000", "--out",
         str(tmp_path / "packed")])
    r = runner.invoke(app, ["synth", "audit", str(tmp_path / "packed")])
    assert r.exit_code == 2 and "packed dataset" in r.output


def test_breakdown_by_env_and_cue(decisions):
    from dataclasses import replace

    train, val, _ = decisions
    val = [replace(d, cue="fact" if d.note.startswith("The ") else "", env="templated" if i % 2 else "other")
           for i, d in enumerate(val)]
    result, _ = am.audit_decisions(train[:600], val)
    assert set(result["by_env"]) == {"templated", "other"} and set(result["by_cue"]) == {"fact", am.NO_CUE}
    assert sum(per["delete_all_read"]["n_decisions"] for per in result["by_cue"].values()) == len(val)
    assert {f["env"] for f in result["flags"] if f["baseline"] == "text_classifier"} >= {None}
    text = am.audit_markdown(result)
    assert "F1 by environment" in text and "Accuracy by cue" in text and "| fact |" in text
