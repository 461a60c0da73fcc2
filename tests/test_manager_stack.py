"""The stacked manager (structure features + the per-response adapter's P(no)): the model scores are the served
decision's, against an independent HF forward; the head uses the model column where it carries the signal and the
structure classifier cannot; it saves and loads; `eval manager --arms stack` fits, plays and reports it."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsteward.models import ADAPTER_META
from kvsteward.synth.traces.baselines import StackClassifier, StructureClassifier, load_baselines, save_baselines
from kvsteward.synth.traces.decisions import decisions_from_trace

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def scores_adapter(tiny_folder, tmp_path_factory):
    """A random (non-zero) LoRA on the tiny model, marked as a scores-trigger adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("scores")
    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    get_peft_model(base, LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False)).save_pretrained(folder)
    (folder / ADAPTER_META).write_text('{"trigger": "scores", "adapter_scope": "aux", "min_confidence": 0.5}')
    return folder


@pytest.fixture(scope="module")
def scorer(tiny_folder, scores_adapter):
    from kvsteward.serve.engine import Engine

    return Engine.load(str(tiny_folder), adapter=str(scores_adapter))


@pytest.fixture(scope="module")
def trace():
    from kvsteward.synth.traces.generate import generate_traces

    return next(t for t in generate_traces(6, seed=5) if len(t.cursors()) >= 4)


def _hf_p_no(engine, messages: list[dict], open_cursors: list[int]) -> dict[int, float]:
    """P(no) per read open cursor by plain HF forwards: the context through the base model (adapter off), the trigger
    through the adapter on the base model's cache."""
    from kvsteward.serve.manager.scores import needless, trigger_ids
    from kvsteward.synth.chat import message_token_ids
    from kvsteward.synth.traces.hindsight import unread_cursors

    tok, model = engine.tokenizer, engine.model
    context = [i for ids in message_token_ids(tok, messages) for i in ids]
    trig, slots = trigger_ids(tok, messages, open_cursors)
    with torch.no_grad():
        with model.disable_adapter():
            past = model(torch.tensor([context]), use_cache=True).past_key_values
        logits = model(torch.tensor([trig]), past_key_values=past, use_cache=True).logits[0]
    p = dict(zip(sorted(open_cursors), needless(logits, slots, tok), strict=True))
    unread = set(unread_cursors(messages))
    return {c: v for c, v in p.items() if c not in unread}


def test_scored_decisions_are_the_uncompressed_decisions_with_the_adapters_reading(scorer, trace):
    from kvsteward.eval.manager.stack import scored_decisions

    got = scored_decisions(scorer, trace, every=2)
    plain = decisions_from_trace(trace, every=2)
    assert len(got) == len(plain) > 3
    assert [replace(d, model_score=None) for d in got] == plain  # the same decisions, labels and features
    for b in sorted({d.boundary for d in got}):
        at = [d for d in got if d.boundary == b]
        want = _hf_p_no(scorer, trace.messages[:b], [c for c in trace.cursors() if c < b])
        assert {d.cursor for d in at} == set(want)
        for d in at:
            assert d.model_score == pytest.approx(want[d.cursor], abs=1e-4)
    assert len({round(d.model_score, 6) for d in got}) > 1  # the random adapter reads the responses differently


def test_the_stack_uses_the_model_column_where_structure_has_no_signal(tmp_path):
    """Labels that only the model score predicts: the stack separates them, the structure classifier (the same trees
    without that column) cannot; saved and loaded, its scores are identical; an unscored decision is refused."""
    from kvsteward.synth.traces.decisions import Decision
    from kvsteward.synth.traces.structure import FEATURES

    rng = np.random.default_rng(0)

    def decisions(n: int, seed_offset: int) -> list:
        out = []
        for i in range(n):
            p = float(rng.uniform())
            out.append(Decision(f"t{(i + seed_offset) % 10}", "x", 4, i, p > 0.5, "", "task", "body", "note", "call",
                                1, 0, tuple(float(v) for v in rng.normal(size=len(FEATURES))), p))
        return out

    train, test = decisions(300, 0), decisions(200, 3)
    stack, structure = StackClassifier().fit(train), StructureClassifier().fit(train)
    labels = np.array([d.label for d in test])

    def f1(pred):
        tp = int((pred & labels).sum())
        return 2 * tp / (pred.sum() + labels.sum())

    everything = f1(np.ones(len(test), bool))  # delete-all-read: what no signal gives
    assert f1(stack.predict(test)) > 0.95 and f1(structure.predict(test)) < everything + 0.05 < 0.95
    save_baselines({"stack": stack}, tmp_path)
    again = load_baselines(tmp_path)["stack"]
    assert isinstance(again, StackClassifier) and np.array_equal(again.scores(test), stack.scores(test))
    with pytest.raises(ValueError, match="carry no model score"):
        stack.scores([replace(test[0], model_score=None)])


def test_the_stack_arm_decides_as_its_head_on_the_replays_session(scorer, trace):
    """Played by `evaluate`, the arm's first decision is the head's on the scored uncompressed decisions (nothing is
    deleted before the first boundary); a head that never deletes leaves the replay uncompressed."""
    from kvsteward.eval.manager.evaluate import Tally, replay
    from kvsteward.eval.manager.stack import StackArm, scored_decisions

    scored = scored_decisions(scorer, trace, every=2)
    head = StackClassifier().fit([replace(d, label=(d.model_score >= np.median([x.model_score for x in scored])))
                                  for d in scored])
    first = min(d.boundary for d in scored)
    want = head.delete([d for d in scored if d.boundary == first])
    seen = []
    arm = StackArm(head)

    def spy(session, messages, open_cursors):
        d = arm.decide(session, messages, open_cursors)
        seen.append((len(messages), set(d.del_cursors)))
        return d

    replay(scorer, trace, 2, spy, Tally())
    assert (first, want) in seen and want
    never = StackClassifier().fit(scored)
    never.points = {"f1": {"threshold": None}, "safe": None}
    t = Tally()
    replay(scorer, trace, 2, StackArm(never).decide, t)
    assert t.deleted == 0 and t.decisions == len(scored)


def _cli(args):
    from kvsteward.pipelines.cli import app

    return CliRunner().invoke(app, args)


def test_eval_manager_fits_plays_and_reports_the_stack(tiny_folder, scores_adapter, tmp_path):
    from kvsteward.synth.traces.generate import generate_traces
    from kvsteward.synth.traces.trace import write_traces

    traces = tmp_path / "traces"
    trs = [t for t in generate_traces(12, seed=5) if len(t.cursors()) >= 4]
    for i, t in enumerate(trs):
        t.split = "train" if i % 2 else "test"
    write_traces(traces, trs, {"seed": 5})
    (tmp_path / "card.json").write_text(json.dumps({"source_traces": str(traces)}))  # the rules' and stack's fit
    head = tmp_path / "head"
    common = ["eval", "manager", "--model", str(tiny_folder), "--data", str(tmp_path), "--traces", str(traces),
              "--split", "test", "--every", "2", "--limit", "1", "--no-mlflow", "--json", "--no-base",
              "--arms", "structure,stack"]
    res = _cli([*common, "--scores-adapter", str(scores_adapter), "--stack-fit", "2", "--stack-head", str(head)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["arms"] == ["structure", "adapter_scores", "stack"]
    for key in ("f1", "harmful_rate", "deleted", "peak_tokens_reduction", "n_decisions"):
        assert key in out["stack"], key
    assert out["stack"]["n_decisions"] > 0 and out["stack_fit"]["train_traces"] == 2
    assert (head / "baselines.json").is_file()
    scored = [json.loads(line) for line in (head / "scored_decisions.jsonl").read_text().splitlines()]
    assert len(scored) == out["stack_fit"]["decisions"] and all(d["model_score"] is not None for d in scored)
    again = _cli([*common, "--scores-adapter", str(scores_adapter), "--stack-head", str(head)])  # read, not refit
    assert again.exit_code == 0, again.output
    second = json.loads(again.stdout.strip().splitlines()[-1])
    assert second["stack_fit"]["source"] == str(head) and second["stack"] == out["stack"]
    bad = _cli(common)
    assert bad.exit_code == 2 and "--scores-adapter" in " ".join(bad.output.split())
    # a per-response --adapter carries the stack itself (one engine, one reference replay): the same head, the same
    # decisions as on the second engine
    alone = _cli([*common[:-1], "stack", "--adapter", str(scores_adapter), "--stack-head", str(head)])
    assert alone.exit_code == 0, alone.output
    third = json.loads(alone.stdout.strip().splitlines()[-1])
    assert third["arms"] == ["stack"] and third["stack"] == out["stack"]


def test_eval_choose_fits_the_stack_and_serve_loads_it_with_its_adapter(tiny_folder, scores_adapter, tmp_path,
                                                                        monkeypatch):
    """`steward eval choose --arms ...,stack` with a per-response adapter: the stack is fitted on train traces and
    scored on the validation replays beside the rules; the folder keeps its head; forced to the stack, `steward
    serve --manager` loads the adapter and serves the head (`StackManager`), and so does the SGLang manager."""
    import uvicorn

    import kvsteward.serve.server.api as api
    from kvsteward.serve.manager.rule import ManagerError, load_choice, save_choice
    from kvsteward.serve.manager.stack import StackManager
    from kvsteward.serve.sglang.manager import SglangManager
    from kvsteward.synth.traces.generate import generate_traces
    from kvsteward.synth.traces.trace import write_traces

    traces = tmp_path / "traces"
    trs = [t for t in generate_traces(12, seed=5) if len(t.cursors()) >= 4]
    for i, t in enumerate(trs):
        t.split = "train" if i % 2 else "validation"
    write_traces(traces, trs, {"seed": 5})
    (tmp_path / "card.json").write_text(json.dumps({"source_traces": str(traces)}))
    out = tmp_path / "m"
    r = _cli(["eval", "choose", "--model", str(tiny_folder), "--adapter", str(scores_adapter), "--data",
              str(tmp_path), "--every", "2", "--limit", "1", "--arms", "structure,stack", "--stack-fit", "2",
              "--out", str(out), "--no-mlflow", "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(body["validation"]) == {"structure", "stack"} and body["stack_fit"]["train_traces"] == 2
    assert body["validation"]["stack"]["n_decisions"] == body["validation"]["structure"]["n_decisions"] > 0
    rules = load_baselines(out / "rules")
    assert {"structure", "stack"} <= set(rules)
    forced = tmp_path / "forced"
    save_choice(forced, "stack", rules, str(scores_adapter), {"reason": "test"})
    choice = load_choice(forced)
    assert isinstance(choice.rule, StackManager) and choice.serves_adapter and choice.adapter_dir == str(scores_adapter)
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(api, "create_app", lambda engine, config: seen.update(config=config, engine=engine))
    r = _cli(["serve", "--model", str(tiny_folder), "--data-dir", str(tmp_path / "d"), "--manager", str(forced)])
    assert r.exit_code == 0, r.output
    assert isinstance(seen["config"].aux.rule, StackManager) and seen["config"].aux.use_adapter
    assert seen["engine"].is_peft and seen["engine"].trigger_style == "scores"
    sgl = SglangManager.for_choice(seen["engine"].tokenizer, str(forced), "m")  # its request, then the head
    assert isinstance(sgl.rule, StackManager) and sgl.trigger_style == "scores" and sgl.lora == "m"
    with pytest.raises(ManagerError, match="under a LoRA name"):
        SglangManager.for_choice(seen["engine"].tokenizer, str(forced), None)
    with pytest.raises(ManagerError, match="no adapter folder"):
        save_choice(tmp_path / "x", "stack", rules, None, {})
