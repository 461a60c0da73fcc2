"""Choosing the aux close bias on held-out traces (`steward eval calibrate`): the rule on hand-worked sweeps, the sweep
against `evaluate` run bias by bias, the record in the adapter, and the default it becomes for eval and serving."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvsteward.eval.manager.calibrate import check_biases, check_confidences, choose, record, sweep
from kvsteward.eval.manager.evaluate import evaluate
from kvsteward.models import ADAPTER_META
from kvsteward.serve.engine import Engine
from kvsteward.synth.traces.generate import generate_traces

torch.set_num_threads(1)


def _s(f1: float, deleted: int, harmful: int) -> dict:
    return {"f1": f1, "deleted": deleted, "harmful": harmful,
            "harmful_rate": harmful / deleted if deleted else float("nan")}


def test_choose_the_highest_f1_that_meets_the_harm_target():
    by = {0.0: _s(0.90, 100, 10), 1.0: _s(0.88, 80, 1), 2.0: _s(0.70, 40, 0)}
    c = choose(by, max_harm=0.02, min_f1=0.8)
    assert (c.close_bias, c.met) == (1.0, True)  # 0 harms 10 %, 2 loses F1
    # two meet both: the higher F1; on a tie, the lower bias (it deletes more)
    by[0.5] = _s(0.89, 90, 1)
    assert choose(by, 0.02, 0.8).close_bias == 0.5
    by[0.25] = _s(0.89, 95, 1)
    assert choose(by, 0.02, 0.8).close_bias == 0.25


def test_choose_the_lowest_harm_when_the_target_is_not_met():
    by = {0.0: _s(0.90, 100, 10), 1.0: _s(0.85, 80, 4), 2.0: _s(0.50, 40, 0)}
    c = choose(by, max_harm=0.02, min_f1=0.8)
    assert (c.close_bias, c.met) == (1.0, False) and "no arm has harmful rate <= 0.02" in c.reason
    # no bias keeps F1: the lowest harm of all, said so
    c = choose(by, max_harm=0.02, min_f1=0.95)
    assert (c.close_bias, c.met) == (2.0, False) and "no arm keeps F1 >= 0.95" in c.reason
    # deleting nothing harms nothing (0 / 0), but it is no rule for a manager: never chosen while an arm acts, even
    # when F1 is not asked for; when no arm acts the choice says so
    by = {0.0: _s(0.9, 50, 5), 9.0: _s(0.0, 0, 0)}
    assert choose(by, 0.02, 0.8).close_bias == 0.0 and choose(by, 0.02, 0.0).close_bias == 0.0
    c = choose({0.0: _s(0.0, 0, 0), 1.0: _s(0.0, 0, 0)}, 0.02, 0.0, {0.8: _s(0.0, 0, 0)})
    assert (c.close_bias, c.min_confidence, c.met) == (0.0, None, False) and "deletes anything" in c.reason
    # a confidence threshold that deletes nothing does not "meet" the harm target (the demo's 60-step adapter)
    c = choose({0.0: _s(0.53, 19, 7), 1.0: _s(0.42, 13, 4)}, 0.02, 0.0, {0.8: _s(0.0, 0, 0), 0.9: _s(0.0, 0, 0)})
    assert (c.close_bias, c.min_confidence, c.met) == (1.0, None, False)
    with pytest.raises(ValueError, match="no bias was measured"):
        choose({}, 0.02, 0.8)


def test_biases_are_refused_by_name():
    assert check_biases([2.0, 0.0, 2.0]) == [0.0, 2.0]
    with pytest.raises(ValueError, match="at least one"):
        check_biases([])
    with pytest.raises(ValueError, match="finite"):
        check_biases([0.0, float("inf")])


def test_sweep_scores_each_bias_as_evaluate_does(manager_setup):
    """One uncompressed replay shared by every bias changes nothing: each bias's summary equals `evaluate` run on
    that bias alone, and the reference equals its reference. The biases reach the decoder (huge against closing:
    every read cursor deleted; huge toward it: none)."""
    engine, traces = manager_setup
    biases = [-1e4, 0.0, 1e4]
    out = sweep(engine, traces, biases, every=2)
    assert sorted(out["by_bias"]) == biases and out["n_traces"] == len(traces)
    for b in biases:
        alone = evaluate(engine, traces, every=2, arms=("adapter",), close_bias=b)
        assert json.dumps(out["by_bias"][b], sort_keys=True) == json.dumps(alone["adapter"], sort_keys=True)
        assert out["uncompressed"] == alone["uncompressed"]
    assert out["by_bias"][-1e4]["recall"] == 1.0 and out["by_bias"][1e4]["deleted"] == 0


@pytest.fixture
def adapter_dir(tiny_folder, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    get_peft_model(base, LoraConfig(r=2, target_modules="all-linear")).save_pretrained(tmp_path / "a")
    (tmp_path / "a" / ADAPTER_META).write_text('{"trigger": "notes", "adapter_scope": "aux"}')
    return tmp_path / "a"


def test_the_record_keeps_the_training_record_and_the_engine_serves_it(tiny_folder, adapter_dir):
    assert Engine.load(str(tiny_folder), adapter=str(adapter_dir)).close_bias == 0.0  # not calibrated: greedy
    by = {0.0: _s(0.9, 50, 5) | {"precision": 0.9, "recall": 0.9, "answer_acc_delta": 0.0},
          1.5: _s(0.85, 40, 0) | {"precision": 1.0, "recall": 0.74, "answer_acc_delta": 0.0}}
    result = {"by_bias": by, "n_traces": 7, "every": 2, "aux_context": "full", "keep_unread": True}
    meta = record(adapter_dir, choose(by, 0.02, 0.8), result, "validation", 0.02, 0.8)
    on_disk = json.loads((adapter_dir / ADAPTER_META).read_text())
    assert on_disk == meta and on_disk["trigger"] == "notes" and on_disk["adapter_scope"] == "aux"
    assert on_disk["close_bias"] == 1.5 and on_disk["calibration"]["met"] is True
    assert on_disk["calibration"]["by_bias"]["1.5"]["harmful_rate"] == 0.0
    assert on_disk["calibration"]["split"] == "validation" and on_disk["calibration"]["traces"] == 7
    engine = Engine.load(str(tiny_folder), adapter=str(adapter_dir))
    assert engine.close_bias == 1.5 and engine.trigger_style == "notes"
    (adapter_dir / ADAPTER_META).write_text('{"trigger": "notes", "close_bias": "high"}')
    with pytest.raises(ValueError, match="aux close_bias must be a finite number of nats, got high"):
        Engine.load(str(tiny_folder), adapter=str(adapter_dir))


def _traces_dir(tmp_path):
    from kvsteward.synth.traces.trace import write_traces

    traces = [t for t in generate_traces(20, seed=5)]
    assert any(t.split == "validation" and len(t.cursors()) >= 4 for t in traces)
    keep = [t for t in traces if t.split == "validation" and len(t.cursors()) >= 4][:1]
    write_traces(tmp_path / "traces", keep, {"seed": 5})
    return tmp_path / "traces"


def _cli(args):
    from kvsteward.pipelines.cli import app

    return CliRunner().invoke(app, args)


def test_calibrate_cli_records_the_choice_and_eval_and_serve_use_it(tiny_folder, adapter_dir, tmp_path,
                                                                    monkeypatch):
    """End to end on a tiny model: the sweep chooses (a huge bias against closing deletes, so it has the higher F1),
    writes it into kvsteward.json; `steward eval manager` then runs the adapter arm at that bias (the base arm at 0)
    and `steward serve` gives it to the aux thread; an explicit flag still wins."""
    traces = _traces_dir(tmp_path)
    common = ["--model", str(tiny_folder), "--adapter", str(adapter_dir), "--data", str(tmp_path), "--traces",
              str(traces), "--split", "validation", "--every", "2", "--limit", "1", "--no-mlflow", "--json"]
    res = _cli(["eval", "calibrate", *common, "--biases", "1e4,-1e4", "--max-harm", "1", "--min-f1", "0"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["close_bias"] == -1e4 and out["met"] is True and out["written"] is True
    assert out["by_bias"]["-10000.0"]["deleted"] > 0 and out["by_bias"]["10000.0"]["deleted"] == 0
    assert sorted(out["by_confidence"]) == ["0.8", "0.9"] and out["min_confidence"] is None  # the default thresholds
    meta = json.loads((adapter_dir / ADAPTER_META).read_text())
    assert meta["close_bias"] == -1e4 and meta["trigger"] == "notes" and meta["calibration"]["traces"] == 1

    res = _cli(["eval", "manager", *common, "--arms", "base,adapter"])
    assert res.exit_code == 0, res.output
    ev = json.loads(res.stdout.strip().splitlines()[-1])
    assert ev["close_bias"] == {"base": 0.0, "adapter": -1e4}
    assert ev["adapter"]["deleted"] == out["by_bias"]["-10000.0"]["deleted"]
    res = _cli(["eval", "manager", *common, "--arms", "base,adapter", "--close-bias", "1e4"])
    assert json.loads(res.stdout.strip().splitlines()[-1])["adapter"]["deleted"] == 0

    import uvicorn

    import kvsteward.serve.server.api as api

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)  # the app is not served: only its config is read
    monkeypatch.setattr(api, "create_app", lambda engine, config: seen.update(aux=config.aux))
    serve = ["serve", "--model", str(tiny_folder), "--adapter", str(adapter_dir), "--data-dir", str(tmp_path / "d")]
    assert _cli(serve).exit_code == 0 and seen.pop("aux").close_bias == -1e4
    assert _cli([*serve, "--aux-close-bias", "0.5"]).exit_code == 0 and seen.pop("aux").close_bias == 0.5


def test_calibrate_cli_refuses_bad_input_before_loading_anything(tmp_path, adapter_dir):
    base = ["eval", "calibrate", "--data", str(tmp_path), "--no-mlflow"]
    res = _cli([*base, "--adapter", str(adapter_dir), "--biases", "0,high"])
    assert res.exit_code == 2 and "--biases must be comma-separated finite numbers" in res.output
    res = _cli([*base, "--adapter", str(adapter_dir), "--biases", "0,nan"])
    assert res.exit_code == 2 and "--biases must be" in res.output
    res = _cli([*base, "--adapter", str(tmp_path / "none")])
    assert res.exit_code == 2 and "adapter_config.json" in res.output
    res = _cli([*base, "--adapter", str(adapter_dir), "--max-harm", "2"])
    assert res.exit_code == 2 and "--max-harm and --min-f1 are rates" in res.output
    res = _cli([*base, "--adapter", str(adapter_dir), "--aux-context", "task"])
    assert res.exit_code == 2 and "--aux-context must be one of full, first" in res.output


def test_eval_cli_workers_and_journal(tiny_folder, adapter_dir, tmp_path):
    """`--workers 2` (each process loads the model and adapter itself) gives the serial result; `--journal` keeps the
    finished traces, a rerun reads them instead of playing, other settings are refused by name; bad values are
    refused before anything loads."""
    from kvsteward.synth.traces.trace import write_traces

    keep = [t for t in generate_traces(30, seed=5) if t.split == "validation" and len(t.cursors()) >= 4][:2]
    assert len(keep) == 2
    write_traces(tmp_path / "traces", keep, {"seed": 5})
    common = ["eval", "manager", "--model", str(tiny_folder), "--adapter", str(adapter_dir), "--data", str(tmp_path),
              "--traces", str(tmp_path / "traces"), "--split", "validation", "--every", "2", "--limit", "2",
              "--close-bias", "-1", "--no-base", "--arms", "adapter", "--no-mlflow", "--json"]
    journal = tmp_path / "j.jsonl"
    runs = [_cli([*common, *extra]) for extra in (["--journal", str(journal)], ["--workers", "2"],
                                                  ["--journal", str(journal)])]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    serial, parallel, resumed = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert serial["adapter"]["aux_calls"] > 0 and "base" not in serial  # --no-base: the adapter arm only
    assert json.dumps(serial, sort_keys=True) == json.dumps(parallel, sort_keys=True) == \
        json.dumps(resumed, sort_keys=True)
    assert len(journal.read_text().splitlines()) == 1 + 2  # header + one line per trace: the rerun played none
    assert "2 of 2 traces already played" in runs[2].output
    other = _cli([*common, "--every", "3", "--journal", str(journal)])  # the last --every wins
    assert other.exit_code == 2 and "other settings (every" in other.output
    bad = _cli(["eval", "calibrate", "--data", str(tmp_path), "--adapter", str(adapter_dir), "--workers", "0"])
    assert bad.exit_code == 2 and "--workers must be >= 1" in bad.output
    bad = _cli(["eval", "manager", "--data", str(tmp_path), "--no-base", "--arms", "base,adapter"])
    assert bad.exit_code == 2 and "--no-base leaves no manager" in bad.output


def test_choose_among_biases_and_confidence_thresholds():
    """The confidence arms (at bias 0) compete with the greedy biases under the same rule: here no bias meets the harm
    target and a threshold does, so the threshold is chosen and named; on a tie in F1 greedy wins (it deletes more)."""
    by = {0.0: _s(0.95, 100, 4), 1.0: _s(0.80, 70, 3)}
    conf = {0.8: _s(0.93, 96, 3), 0.9: _s(0.92, 95, 1), 0.95: _s(0.85, 80, 0)}
    c = choose(by, 0.02, 0.8, conf)
    assert (c.close_bias, c.min_confidence, c.met, c.name) == (0.0, 0.9, True, "confidence 0.9")
    assert choose(by, 0.02, 0.8).min_confidence is None  # without confidence arms: the old rule
    tie = choose({0.0: _s(0.92, 95, 1)}, 0.02, 0.8, conf)
    assert (tie.close_bias, tie.min_confidence, tie.name) == (0.0, None, "bias 0")
    miss = choose(by, 0.005, 0.9, conf)  # none meets both: the lowest harm among those keeping F1
    assert (miss.min_confidence, miss.met) == (0.9, False) and "no arm has harmful rate" in miss.reason
    with pytest.raises(ValueError, match="probabilities in"):
        check_confidences([0.9, 0.0])
    assert check_confidences([0.9, 0.5, 0.9]) == [0.5, 0.9]


def test_sweep_scores_each_confidence_as_evaluate_does(manager_setup):
    engine, traces = manager_setup
    out = sweep(engine, traces, [0.0], every=2, confidences=[0.99, 0.3])
    assert sorted(out["by_confidence"]) == [0.3, 0.99]
    for c in (0.3, 0.99):
        alone = evaluate(engine, traces, every=2, arms=("adapter",), min_confidence=c)
        assert json.dumps(out["by_confidence"][c], sort_keys=True) == json.dumps(alone["adapter"], sort_keys=True)
        assert alone["min_confidence"] == c
    assert out["by_confidence"][0.3]["aux_calls"] > 0


def test_a_recorded_confidence_rule_is_served_and_evaluated(tiny_folder, adapter_dir, tmp_path, monkeypatch):
    """`record` writes the chosen threshold; `Engine.load` reads it; `steward eval manager` runs the adapter arm under
    it (the base arm greedy) and `steward serve` gives it to the aux thread; 0 on either flag means greedy."""
    by = {0.0: _s(0.9, 50, 5) | {"precision": 0.9, "recall": 0.9}}
    conf = {0.7: _s(0.88, 45, 0) | {"precision": 1.0, "recall": 0.8}}
    result = {"by_bias": by, "by_confidence": conf, "n_traces": 3, "every": 2, "aux_context": "full",
              "keep_unread": True}
    meta = record(adapter_dir, choose(by, 0.02, 0.8, conf), result, "validation", 0.02, 0.8)
    assert meta["min_confidence"] == 0.7 and meta["close_bias"] == 0.0
    assert meta["calibration"]["by_confidence"]["0.7"]["harmful_rate"] == 0.0
    assert Engine.load(str(tiny_folder), adapter=str(adapter_dir)).min_confidence == 0.7

    traces = _traces_dir(tmp_path)
    common = ["eval", "manager", "--model", str(tiny_folder), "--adapter", str(adapter_dir), "--data", str(tmp_path),
              "--traces", str(traces), "--split", "validation", "--every", "2", "--limit", "1", "--no-mlflow",
              "--arms", "base,adapter", "--json"]
    ev = json.loads(_cli(common).stdout.strip().splitlines()[-1])
    assert ev["min_confidence"] == {"base": None, "adapter": 0.7}
    ev = json.loads(_cli([*common, "--min-confidence", "0"]).stdout.strip().splitlines()[-1])
    assert ev["min_confidence"] == {"base": None, "adapter": None}
    res = _cli([*common, "--min-confidence", "1.5"])
    assert res.exit_code == 2 and "--min-confidence must be a probability in (0, 1]" in res.output

    import uvicorn

    import kvsteward.serve.server.api as api

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(api, "create_app", lambda engine, config: seen.update(aux=config.aux))
    serve = ["serve", "--model", str(tiny_folder), "--adapter", str(adapter_dir), "--data-dir", str(tmp_path / "d")]
    assert _cli(serve).exit_code == 0 and seen.pop("aux").min_confidence == 0.7
    assert _cli([*serve, "--aux-min-confidence", "0"]).exit_code == 0 and seen.pop("aux").min_confidence is None
    assert _cli([*serve, "--aux-min-confidence", "0.95"]).exit_code == 0 and seen.pop("aux").min_confidence == 0.95
    res = _cli(["serve", "--model", str(tiny_folder), "--aux-min-confidence", "0.9"])
    assert res.exit_code == 2 and "--aux-min-confidence needs a manager" in res.output
    res = _cli([*serve, "--aux-min-confidence", "2"])
    assert res.exit_code == 2 and "min_confidence must be a probability" in res.output
    res = _cli(["eval", "calibrate", "--data", str(tmp_path), "--no-mlflow", "--adapter", str(adapter_dir),
                "--confidences", "0.9,1.2"])
    assert res.exit_code == 2 and "--confidences must be comma-separated probabilities" in res.output


def test_eval_manager_reports_the_scores_adapter_beside_the_list_adapter(tiny_folder, adapter_dir, tmp_path):
    """`--scores-adapter`: a per-response adapter's arm `adapter_scores` (its own engine and reference replay) beside
    the list adapter's, with the contract's metrics; an adapter of another trigger is refused by name."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    scores = tmp_path / "s"
    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    get_peft_model(base, LoraConfig(r=2, target_modules="all-linear")).save_pretrained(scores)
    (scores / ADAPTER_META).write_text('{"trigger": "scores", "adapter_scope": "aux", "min_confidence": 0.0001}')
    traces = _traces_dir(tmp_path)
    common = ["eval", "manager", "--model", str(tiny_folder), "--adapter", str(adapter_dir), "--data", str(tmp_path),
              "--traces", str(traces), "--split", "validation", "--every", "2", "--limit", "1", "--no-mlflow",
              "--json", "--arms", "adapter", "--no-base"]
    res = _cli([*common, "--scores-adapter", str(scores)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["arms"] == ["adapter", "adapter_scores"]
    for key in ("f1", "harmful_rate", "deleted", "peak_tokens_reduction", "n_decisions"):
        assert key in out["adapter_scores"], key
    # a threshold of 1e-4 on P(no): the per-response arm deletes every read response it decides on
    assert out["adapter_scores"]["deleted"] == out["adapter_scores"]["n_decisions"] > 0
    bad = _cli([*common, "--scores-adapter", str(adapter_dir)])
    assert bad.exit_code == 2 and "not scores" in " ".join(bad.output.split())
