"""The manager evaluation's non-model arms: the cheap baselines and the attention-mass rule decide on exactly the
decisions the learned manager faces, and their counts are recomputable by hand from the traces."""

from __future__ import annotations

import math

import pytest
import torch

from kvsteward.eval.manager.arms import SESSION, AttentionArm, RuleArm, attention_mass, fit_attention_threshold
from kvsteward.eval.manager.evaluate import Tally, evaluate, replay, summarize
from kvsteward.synth.traces.baselines import DeleteAllRead, KeepLastK
from kvsteward.synth.traces.decisions import decisions_from_trace
from kvsteward.synth.traces.hindsight import boundaries, expired, unread_cursors

torch.set_num_threads(1)


def _fitted(cls, traces):
    return cls().fit([d for t in traces for d in decisions_from_trace(t, 2)])


def _hand_counts(trace, every, deleting):
    """Replay the decisions of a rule by hand: open cursors, read ones, the rule's deletions, harm."""
    dropped, n, harm, deleted = set(), 0, 0, 0
    last = trace.last_use()
    for b in boundaries(trace, every):
        unread = set(unread_cursors(trace.messages[:b]))
        read = [c for c in trace.cursors() if c < b and c not in dropped and c not in unread]
        got = deleting(read)
        n += len(read)
        deleted += len(got)
        harm += sum(last[c] >= b for c in got)
        dropped |= got
    return n, deleted, harm


def test_delete_all_read_deletes_every_read_open_cursor(manager_setup):
    engine, traces = manager_setup
    arm = RuleArm("delete_all_read", _fitted(DeleteAllRead, traces))
    tally = Tally()
    for t in traces:
        replay(engine, t, 2, arm.decide, tally, session=arm.session)
    hand = [_hand_counts(t, 2, lambda read: set(read)) for t in traces]
    assert tally.decisions == sum(h[0] for h in hand) > 0 and tally.deleted == sum(h[1] for h in hand)
    assert tally.harmful == sum(h[2] for h in hand) and tally.deleted == tally.decisions
    cues = tally.by_cue
    assert sum(r["n"] for r in cues.values()) == tally.decisions
    assert sum(r["fp"] for r in cues.values()) == tally.harmful


def test_keep_last_k_keeps_the_k_most_recent_read_cursors(manager_setup):
    engine, traces = manager_setup
    base = _fitted(KeepLastK, traces)
    base.points["f1"] = {"threshold": 1.0, "setting": {"keep_last": 1}, "train": {}}  # keep one: delete rank >= 1
    arm = RuleArm("keep_last_k", base)
    tally = Tally()
    for t in traces:
        replay(engine, t, 2, arm.decide, tally)
    hand = [_hand_counts(t, 2, lambda read: set(read[:-1])) for t in traces]
    assert (tally.decisions, tally.deleted, tally.harmful) == tuple(sum(h[i] for h in hand) for i in range(3))


def test_attention_mass_is_the_mean_per_query_attention_of_a_cursor(manager_setup):
    engine, traces = manager_setup
    from kvsteward.synth.chat import message_token_ids

    t = traces[0]
    s = engine.session(chunk=512, **SESSION)
    msgs = t.messages[:8]
    for m, ids in zip(msgs, message_token_ids(engine.tokenizer, msgs), strict=True):
        s.append(ids, kind=m["role"])
    assert s.table.n == s.n_logical  # the scoring session never evicts
    cursors = [c for c in t.cursors() if c < 8]
    got = attention_mass(s, cursors)
    step, logical = s.table.field("step"), s.table.field("logical")
    cum = s.table.field("cumulative").double()
    for c in cursors:
        rows = (step == c).nonzero()[:, 0].tolist()
        hand = sum(float(cum[r]) / max(1, s.n_logical - 1 - int(logical[r])) for r in rows) / len(rows)
        assert got[c] == pytest.approx(hand, rel=1e-9) and got[c] > 0


def test_attention_arm_thresholds_and_the_fit(manager_setup):
    engine, traces = manager_setup
    every = 2
    none = AttentionArm(None)
    assert none.decide(None, traces[0].messages[:4], [3]).del_cursors == []
    all_read = AttentionArm(math.inf)
    ref, everything = Tally(), Tally()
    for t in traces:
        replay(engine, t, every, None, ref, session=dict(SESSION))
        replay(engine, t, every, all_read.decide, everything, session=all_read.session)
    hand = [_hand_counts(t, every, lambda read: set(read)) for t in traces]
    assert everything.deleted == sum(h[1] for h in hand)
    # the scoring session is the uncompressed replay: same peak and answers as the plain one
    plain = Tally()
    for t in traces:
        replay(engine, t, every, None, plain)
    assert plain.peak == ref.peak and plain.correct == ref.correct
    fit = fit_attention_threshold(engine, traces, every)
    n = sum(_hand_counts(t, every, lambda read: set())[0] for t in traces)  # every read cursor at every boundary
    assert fit["fit_decisions"] == n and 0 <= fit["fit"]["f1"] <= 1
    assert fit["fit"]["tp"] + fit["fit"]["fn"] == sum(
        len(set(expired(t, b)) - set(unread_cursors(t.messages[:b]))) for t in traces for b in boundaries(t, every))


def test_evaluate_reports_every_arm_on_the_same_traces(manager_setup):
    engine, traces = manager_setup
    rules = {"delete_all_read": RuleArm("delete_all_read", _fitted(DeleteAllRead, traces)),
             "attention_mass": AttentionArm(None)}
    out = evaluate(engine, traces, every=2, arms=("base",), close_bias=-1e4, rules=rules)
    assert {"base", "delete_all_read", "attention_mass", "uncompressed"} <= set(out)
    # a huge bias against closing lists every deletable id: the base model deletes exactly what delete_all_read does
    assert out["base"]["deleted"] == out["delete_all_read"]["deleted"] == out["delete_all_read"]["n_decisions"]
    assert out["attention_mass"]["deleted"] == 0 and out["attention_mass"]["peak_tokens_reduction"] == 0
    by_cue = out["delete_all_read"]["by_cue"]
    assert sum(r["n_decisions"] for r in by_cue.values()) == out["delete_all_read"]["n_decisions"]
    summary = summarize(Tally(), Tally(peak=[1], kv_reads=[1]))  # nothing decided: no division by zero
    assert summary["n_decisions"] == 0 and summary["answer_acc"] != summary["answer_acc"]  # NaN
    assert set(expired(traces[0], len(traces[0].messages)))  # (the traces do expire cursors)


def test_eval_manager_cli_reports_every_arm_with_the_contract_metrics(tiny_folder, tmp_path):
    """`steward eval manager --data DS --json`: one object per arm (the adapter arm needs --adapter) with the
    contract's metrics, the baselines fitted on the dataset's train split, the attention threshold on its
    validation traces; `--env` selects a held-out environment, `--traces` an imported folder (`--split all`)."""
    import json

    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app

    runner = CliRunner()

    def ok(args):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        return r.stdout

    ok(["synth", "traces", "--env", "templated,ops", "--tasks", "20", "--seed", "2", "--out", str(tmp_path / "t"),
        "--world-size", "200"])
    ok(["synth", "hindsight", str(tmp_path / "t"), "--every", "2", "--no-plan", "--out", str(tmp_path / "ds")])
    common = ["eval", "manager", "--model", str(tiny_folder), "--data", str(tmp_path / "ds"), "--every", "2",
              "--limit", "1", "--attention-fit", "1", "--no-mlflow", "--json"]
    out = json.loads(ok([*common, "--env", "ops"]).strip().splitlines()[-1])
    arms = ["base", "delete_all_read", "keep_last_k", "text_classifier", "lexical_overlap", "structure",
            "attention_mass"]
    assert out["arms"] == arms and out["envs"] == ["ops"] and out["n_traces"] == 1
    keys = {"f1", "precision", "recall", "harmful_rate", "harmful_rate_ci95", "peak_tokens_reduction",
            "kv_reads_reduction", "answer_acc", "n_decisions"}
    assert all(keys <= set(out[a]) for a in arms)
    assert out["delete_all_read"]["deleted"] == out["delete_all_read"]["n_decisions"] > 0
    assert out["attention_fit"]["fit_traces"] == 1 and set(out["baseline_settings"]) == set(arms[1:6])
    ok(["synth", "export", str(tmp_path / "t"), "--env", "ops", "--split", "test", "--provenance", "--out",
        str(tmp_path / "s.jsonl")])
    ok(["synth", "import", str(tmp_path / "s.jsonl"), "--planner", "provenance", "--out", str(tmp_path / "imp")])
    imp = json.loads(ok([*common, "--traces", str(tmp_path / "imp"), "--split", "all", "--arms",
                         "delete_all_read,keep_last_k", "--fit-envs", "ops"]).strip().splitlines()[-1])
    assert imp["arms"] == ["delete_all_read", "keep_last_k"] and imp["fit_envs"] == ["ops"]
    # the same trace, imported or not, gives the same decisions to the same rule
    same = json.loads(ok([*common, "--env", "ops", "--arms", "delete_all_read,keep_last_k", "--fit-envs", "ops"])
                      .strip().splitlines()[-1])
    for a in imp["arms"]:
        assert imp[a]["n_decisions"] == same[a]["n_decisions"] and imp[a]["deleted"] == same[a]["deleted"]
    bad = runner.invoke(app, [*common, "--arms", "base,oracle"])
    assert bad.exit_code == 2 and "unknown ['oracle']" in bad.output


def test_a_foreign_trace_folder_goes_through_hindsight_audit_and_eval(tiny_folder, tmp_path):
    """A generator the project never made, writing only the documented fields (messages with `[cursor N]` tags and
    `reads`; no env, cues, answer or question): hindsight annotates it, the audit runs, every non-model arm and the
    base model evaluate it (no answer: no answer score)."""
    import json

    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app

    runner = CliRunner()
    lines = []
    for i in range(30):
        msgs = [{"role": "system", "content": "You sort parcels."}, {"role": "user", "content": f"Route batch {i}."}]
        reads: dict[str, list[int]] = {}
        for k in range(4):
            reads[str(len(msgs))] = [len(msgs) - 1] if k else []
            msgs.append({"role": "assistant", "content": f"Checking bin {k}.\n<tool_call>\n{{\"name\": \"bin\", "
                                                         f"\"arguments\": {{\"id\": {k}}}}}\n</tool_call>"})
            msgs.append({"role": "tool", "content": f"[cursor {len(msgs)}] bin {k}: {(i * 7 + k) % 5} parcels"})
        keep = 3 + 2 * (i % 3)  # the summary reads one earlier bin again (which one: by trace)
        reads[str(len(msgs))] = sorted({len(msgs) - 1, keep})
        msgs.append({"role": "assistant", "content": "Done."})
        split = {8: "validation", 9: "test"}.get(i % 10, "train")
        lines.append(json.dumps({"task_id": f"x{i}", "split": split, "messages": msgs, "reads": reads}))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "traces.jsonl").write_text("\n".join(lines) + "\n")

    def ok(args):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        return r.stdout

    card = json.loads(ok(["synth", "hindsight", str(tmp_path / "t"), "--every", "2", "--no-plan", "--out",
                          str(tmp_path / "ds"), "--json"]))
    assert card["audit"]["n_decisions"] > 0 and card["envs"] == {"": 30}
    out = json.loads(ok(["eval", "manager", "--model", str(tiny_folder), "--data", str(tmp_path / "ds"), "--split",
                         "test", "--every", "2", "--limit", "2", "--attention-fit", "1", "--no-mlflow", "--json"])
                     .strip().splitlines()[-1])
    assert all(out[a]["n_decisions"] > 0 for a in out["arms"]) and out["uncompressed"]["answer_acc"] != \
        out["uncompressed"]["answer_acc"]  # NaN: these traces carry no answer


def test_a_multi_environment_test_set_takes_every_environment_alike():
    """`--env a,b --limit N`: the first N traces alternate environments (traces files list them env by env)."""
    from types import SimpleNamespace

    from kvsteward.pipelines.cli_eval import _interleave

    ts = [SimpleNamespace(env=e, i=i) for e, n in (("research", 5), ("ops", 2)) for i in range(n)]
    got = [(t.env, t.i) for t in _interleave(ts)]
    assert got[:4] == [("research", 0), ("ops", 0), ("research", 1), ("ops", 1)] and len(got) == 7
    assert [t.i for t in _interleave(ts) if t.env == "research"] == list(range(5))
