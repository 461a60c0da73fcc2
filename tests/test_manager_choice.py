"""The served manager is chosen on validation and served the same everywhere (issue 45.5): `steward eval choose`
writes a manager folder (the winner and its evidence, the fitted rules); `steward serve --manager`, the aux worker,
the SGLang manager and the evaluation's rule arm decide identically from it; the rules have one fit (uncompressed
decisions of the train traces)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from starlette.testclient import TestClient

from kvsteward.eval.manager.choose import calibrated_summary, choose_manager
from kvsteward.serve.manager.rule import ManagerError, RuleManager, load_choice, save_choice
from kvsteward.serve.manager.worker import AuxConfig
from kvsteward.synth.traces.baselines import DeleteAllRead, StructureClassifier, fit_on_traces
from kvsteward.synth.traces.decisions import decisions_from_trace
from kvsteward.synth.traces.hindsight import boundaries
from kvsteward.synth.traces.trace import read_traces

torch.set_num_threads(1)


def _summary(f1: float, harm: float = 0.0, n: int = 10) -> dict:
    return {"f1": f1, "harmful_rate": harm, "n_decisions": n}


def test_the_best_validation_f1_wins_and_a_tie_goes_to_the_cheaper_arm():
    v = {"adapter": _summary(0.70), "structure": _summary(0.75), "delete_all_read": _summary(0.72)}
    assert choose_manager(v)[0] == "structure"
    v["adapter"] = _summary(0.80)
    arm, reason = choose_manager(v)
    assert arm == "adapter" and "0.800" in reason and "structure 0.750" in reason
    tie = {"adapter": _summary(0.75), "structure": _summary(0.75), "delete_all_read": _summary(0.70)}
    assert choose_manager(tie)[0] == "structure"  # a rule costs no forward
    # the harm cap: only arms within it compete; none within: all compete, and the reason says so
    capped = {"adapter": _summary(0.80, 0.10), "structure": _summary(0.70, 0.01)}
    assert choose_manager(capped, max_harm=0.02)[0] == "structure"
    arm, reason = choose_manager({"adapter": _summary(0.8, 0.1)}, max_harm=0.02)
    assert arm == "adapter" and "not met" in reason
    # an arm that decided nothing (or an undefined F1) never wins; nothing decided at all is an error
    assert choose_manager({"adapter": _summary(math.nan), "structure": _summary(0.1)})[0] == "structure"
    assert choose_manager({"adapter": _summary(0.9, n=0), "structure": _summary(0.1)})[0] == "structure"
    with pytest.raises(ValueError, match="nothing to choose"):
        choose_manager({"structure": _summary(0.5, n=0)})


def test_the_adapter_s_numbers_are_read_at_its_calibrated_rule():
    cal = {"close_bias": 1.0, "min_confidence": None, "chosen": "bias 1",
           "by_bias": {"0.0": _summary(0.1), "1.0": _summary(0.6)}, "by_confidence": {"0.9": _summary(0.3)}}
    assert calibrated_summary(cal)["f1"] == 0.6
    assert calibrated_summary(cal | {"min_confidence": 0.9})["f1"] == 0.3
    with pytest.raises(ValueError, match="no summary"):
        calibrated_summary(cal | {"close_bias": 2.0})


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from typer.testing import CliRunner

    from kvsteward.pipelines.cli import app

    out = tmp_path_factory.mktemp("traces")
    r = CliRunner().invoke(app, ["synth", "traces", "--env", "templated,ops", "--tasks", "20", "--seed", "5",
                                 "--out", str(out / "t"), "--world-size", "200"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["synth", "hindsight", str(out / "t"), "--every", "2", "--no-plan", "--out",
                                 str(out / "ds")])
    assert r.exit_code == 0, r.output
    return out


def test_a_saved_manager_folder_decides_as_the_fitted_rule_everywhere(traces, tmp_path):
    """The rule saved in a manager folder and loaded back decides, at every boundary of unseen traces, exactly what
    the in-memory fit decides (`Baseline.decide_at`); the SGLang manager built from the folder decides the same
    without a request (its URL is unreachable), and so does the evaluation's rule arm."""
    from kvsteward.eval.manager.arms import RuleArm
    from kvsteward.models import load_tokenizer
    from kvsteward.serve.sglang.manager import SglangManager

    all_traces = read_traces(traces / "t")
    train = [t for t in all_traces if t.split == "train"]
    fitted = fit_on_traces(train, 2, ["structure", "delete_all_read"])
    save_choice(tmp_path / "m", "structure", fitted, None, {"reason": "test"})
    choice = load_choice(tmp_path / "m")
    assert choice.is_rule and choice.arm == "structure" and choice.record["reason"] == "test"
    sgl = SglangManager.for_choice(load_tokenizer("smollm2"), str(tmp_path / "m"), None)
    arm = RuleArm("structure", fitted["structure"])
    kept = deleted = 0
    for t in [t for t in all_traces if t.split == "test"][:4]:
        for b in boundaries(t, 2):
            msgs, open_c = t.messages[:b], [c for c in t.cursors() if c < b]
            want = sorted(fitted["structure"].decide_at(msgs, open_c))
            assert choice.rule.decide(msgs, open_c).del_cursors == want
            assert sgl.decide("http://127.0.0.1:9", None, msgs, [], None, open_c).del_cursors == want
            assert arm.decide(None, msgs, open_c).del_cursors == want
            deleted += len(want)
            kept += len(open_c) - len(want)
    assert deleted and kept  # the rule both deletes and keeps: the comparison is not vacuous


def test_the_one_fit_reads_uncompressed_trace_decisions(traces):
    """`fit_on_traces` is `fit_all` over `decisions_from_trace` (nothing deleted before): the same scores."""
    train = [t for t in read_traces(traces / "t") if t.split == "train"]
    decisions = [d for t in train for d in decisions_from_trace(t, 2)]
    a = fit_on_traces(train, 2, ["structure"])["structure"]
    b = StructureClassifier().fit(decisions)
    assert a.points == b.points and (a.scores(decisions) == b.scores(decisions)).all()
    with pytest.raises(ValueError, match="no read tool response"):
        fit_on_traces(train[:1], 10_000, ["structure"])


def test_a_manager_folder_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(ManagerError, match="no manager.json"):
        load_choice(tmp_path)
    with pytest.raises(ManagerError, match="no adapter folder"):
        save_choice(tmp_path / "a", "adapter", {}, None, {})
    with pytest.raises(ManagerError, match="not among the fitted rules"):
        save_choice(tmp_path / "a", "structure", {}, None, {})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manager.json").write_text(json.dumps({"arm": "adapter", "adapter_dir": str(tmp_path / "x")}))
    with pytest.raises(ManagerError, match="does not exist"):
        load_choice(tmp_path / "b")
    (tmp_path / "b" / "manager.json").write_text(json.dumps({"arm": "oracle"}))
    with pytest.raises(ManagerError, match="unknown manager arm"):
        load_choice(tmp_path / "b")


def _keep_all() -> DeleteAllRead:
    """delete-all-read at an operating point that deletes nothing: a rule that disagrees with the model below."""
    rule = DeleteAllRead()
    rule.points = {"f1": {"threshold": None, "setting": {"delete_nothing": True}, "train": {}}, "safe": None}
    return rule


def test_the_server_s_aux_worker_serves_the_rule_not_the_model(tmp_path):
    """With `AuxConfig.rule` the worker's decision at the boundary is the rule's on the boundary's messages; the
    model (whose decoder here lists every read response) is not asked."""
    from kvsteward.serve.manager.decode import _candidates
    from kvsteward.serve.server.api import ServerConfig, create_app
    from kvsteward.serve.server.testing import live, tiny_chat_engine, turn

    engine = tiny_chat_engine(seed=3)
    ids, texts = _candidates(engine.tokenizer)
    bias = torch.zeros(engine.vocab_size)
    bias[[i for i, t in zip(ids, texts, strict=True) if "]" in t]] = -1e4
    engine.model.lm_head.register_forward_hook(lambda m, inp, out: out + bias)
    t0 = {"messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find X."}],
          "max_tokens": 3}
    turns = [t0] + [{"messages": [{"role": "tool", "content": f"[cursor {i}] result text " * 3}], "max_tokens": 3}
                    for i in (3, 5)]

    def pending(rule):
        app = create_app(engine, ServerConfig(data_dir=tmp_path / str(id(rule)),
                                              aux=AuxConfig(every=2, max_tokens=16, use_adapter=False, rule=rule)))
        c = TestClient(app)
        sid = c.post("/v1/sessions", json={}).json()["id"]
        for body in turns:
            turn(c, sid, body)
        assert app.state.store.worker.wait_idle(60)
        rec = live(app, sid)
        return dict(rec.aux_pending), rec.messages

    model_made, _ = pending(None)
    assert model_made["del_cursors"] == [3]  # the model lists the read response (5 is unread: kept)
    rule = RuleManager("delete_all_read", _keep_all())
    got, msgs = pending(rule)
    assert got["del_cursors"] == [] == rule.decide(msgs[:6], [3, 5]).del_cursors
    assert got["text"] == rule.decide(msgs[:6], [3, 5]).text != model_made["text"]
    everything = RuleManager("delete_all_read", _keep_all())
    everything.baseline.points["f1"] = {"threshold": 1.0, "setting": {}, "train": {}}  # every read response goes
    got, msgs = pending(everything)
    assert got["del_cursors"] == [3] == everything.decide(msgs[:6], [3, 5]).del_cursors


def test_eval_choose_writes_the_manager_that_serve_loads(traces, tiny_folder, tmp_path, monkeypatch):
    """`steward eval choose` on validation: every candidate scored on the same replays, the winner is
    `choose_manager`'s, the folder serves it (`steward serve --manager`), and flags a rule cannot honour are
    refused by name."""
    import uvicorn
    from typer.testing import CliRunner

    import kvsteward.serve.server.api as api
    from kvsteward.pipelines.cli import app

    runner = CliRunner()
    out = tmp_path / "m"
    r = runner.invoke(app, ["eval", "choose", "--model", str(tiny_folder), "--data", str(traces / "ds"), "--every",
                            "2", "--limit", "2", "--arms", "delete_all_read,structure", "--out", str(out),
                            "--no-mlflow", "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout.strip().splitlines()[-1])
    v = body["validation"]
    assert set(v) == {"delete_all_read", "structure"} and body["split"] == "validation"
    assert v["delete_all_read"]["n_decisions"] > 0 and v["structure"]["n_decisions"] > 0  # (each replay its own)
    assert body["choice"] == choose_manager(v)[0] == load_choice(out).arm
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(api, "create_app", lambda engine, config: seen.update(config=config))
    args = ["serve", "--model", str(tiny_folder), "--data-dir", str(tmp_path / "d"), "--manager", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert seen["config"].aux.rule.name == body["choice"] and not seen["config"].aux.use_adapter
    for flags in (["--aux-plan"], ["--aux-close-bias", "1"], ["--aux-delete-unread"]):
        bad = runner.invoke(app, [*args, *flags])
        assert bad.exit_code == 2 and "decodes nothing" in _flat(bad.output)
    bad = runner.invoke(app, [*args, "--aux-base"])
    assert bad.exit_code == 2 and "excludes --adapter and --aux-base" in _flat(bad.output)
    bad = runner.invoke(app, [*args[:-1], str(tmp_path)])
    assert bad.exit_code == 2 and "no manager.json" in _flat(bad.output)


def _flat(text: str) -> str:
    """A CLI error as one line: rich's box and its line breaks removed."""
    import re

    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def test_choose_reads_the_rules_the_calibration_played_and_refuses_other_traces(traces, tiny_folder, tmp_path,
                                                                                monkeypatch):
    """With `--calibration` holding the rules' summaries on the same traces at the same fitted setting, choose replays
    nothing (the model is never loaded); a rule fitted to another setting is replayed; a calibration played on
    other traces is refused by name."""
    from typer.testing import CliRunner

    import kvsteward.eval.manager.evaluate as ev
    from kvsteward.pipelines.cli import app
    from kvsteward.synth.traces.trace import read_traces

    every, limit = 2, 2
    train = [t for t in read_traces(traces / "t") if t.split == "train"]
    fitted = fit_on_traces(train, every, ["delete_all_read", "structure"])
    r = CliRunner().invoke(app, ["eval", "choose", "--model", str(tiny_folder), "--data", str(traces / "ds"),
                                 "--every", str(every), "--limit", str(limit), "--arms", "delete_all_read,structure",
                                 "--out", str(tmp_path / "ref"), "--no-mlflow", "--json"])
    assert r.exit_code == 0, r.output
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    summaries = {a: ref["validation"][a] | {"f1": f} for a, f in (("delete_all_read", 0.9), ("structure", 0.2))}
    cal = {"close_bias": 0.0, "min_confidence": None, "by_bias": {"0.0": _summary(0.1)}, "by_confidence": {},
           "every": every, "task_ids": None, "rules": summaries,
           "rule_settings": json.loads(json.dumps({a: b.points for a, b in fitted.items()}))}
    from kvsteward.pipelines.cli_eval import _traces

    cal["task_ids"] = [t.task_id for t in _traces(traces / "ds", None, "validation", limit, "")]
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    loads = []
    real_load = ev.load_engine
    monkeypatch.setattr(ev, "load_engine", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    args = ["eval", "choose", "--model", str(tiny_folder), "--data", str(traces / "ds"), "--every", str(every),
            "--limit", str(limit), "--arms", "delete_all_read,structure", "--calibration", str(tmp_path / "cal.json"),
            "--no-mlflow", "--json"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout.strip().splitlines()[-1])
    assert not loads and body["choice"] == "delete_all_read"  # the calibration's numbers, not a replay's
    assert body["sources"] == {"delete_all_read": "calibration", "structure": "calibration"}
    cal["rule_settings"]["structure"] = {"f1": None, "safe": None}  # another fit: structure is replayed
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "m2")])
    body = json.loads(r.stdout.strip().splitlines()[-1])
    assert loads and body["sources"] == {"delete_all_read": "calibration", "structure": "replayed"}
    assert body["validation"]["structure"]["f1"] == ref["validation"]["structure"]["f1"]
    cal["task_ids"] = cal["task_ids"][:1]
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    bad = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "m3")])
    assert bad.exit_code == 2 and "played on other traces" in _flat(bad.output)
