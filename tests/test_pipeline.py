"""Pipeline stage caching: a finished stage is skipped, a changed input reruns it and everything downstream."""

from __future__ import annotations

import io
import json
import sys

import pytest

from kvsteward.pipelines.pipeline import PipelineConfig, Stage, run_pipeline


def _stages(a: int, fail: bool = False) -> list[Stage]:
    def cmd(name):
        code = "import json, sys; print('progress'); print(json.dumps({'stage': sys.argv[1]}))"
        if fail and name == "b":
            code = "import sys; sys.exit(3)"
        return lambda out, up: ["-c", code, name]

    return [Stage("a", {"x": a}, [], cmd("a")), Stage("b", {}, ["a"], cmd("b")), Stage("c", {}, [], cmd("c"))]


def test_cache_skip_and_invalidation(tmp_path):
    run = lambda stages: run_pipeline(PipelineConfig(), tmp_path, log=lambda m: None, mlflow_log=False,  # noqa: E731
                                      stage_list=stages, launcher=[sys.executable])
    first = run(_stages(1))
    assert {k: v["cached"] for k, v in first.items()} == {"a": False, "b": False, "c": False}
    assert first["b"]["result"] == {"stage": "b"}
    again = run(_stages(1))
    assert all(v["cached"] for v in again.values())
    changed = run(_stages(2))  # a's input changed: a and its downstream b rerun, independent c stays cached
    assert {k: v["cached"] for k, v in changed.items()} == {"a": False, "b": False, "c": True}
    assert changed["a"]["hash"] != first["a"]["hash"] and changed["b"]["hash"] != first["b"]["hash"]


def test_failed_stage_is_not_marked_done_and_resumes(tmp_path):
    kw = dict(log=lambda m: None, mlflow_log=False, launcher=[sys.executable])
    with pytest.raises(RuntimeError, match="stage b failed"):
        run_pipeline(PipelineConfig(), tmp_path, stage_list=_stages(1, fail=True), **kw)
    done = run_pipeline(PipelineConfig(), tmp_path, stage_list=_stages(1), **kw)
    assert done["a"]["cached"] and not done["b"]["cached"]
    assert json.loads((tmp_path / f"b-{done['b']['hash']}" / "stage.json").read_text())["result"] == {"stage": "b"}


def test_findings_table_fits_an_80_column_log(monkeypatch):
    """`make demo` prints into a log (no tty: rich uses 80 columns); every manager column must stay readable."""
    from rich.console import Console

    import kvsteward.pipelines.cli_pipeline as cli

    monkeypatch.setattr(cli, "console", Console(width=80, record=True, file=io.StringIO()))
    arm = {"f1": 0.74, "precision": 0.59, "recall": 1.0, "harmful_rate": 0.41, "parse_fail_rate": 0.0,
           "peak_tokens_reduction": 0.35, "kv_reads_reduction": 0.32}
    cli._print_findings({"manager": {"result": {"base": arm, "adapter": dict(arm, f1=0.08)}}})
    text = cli.console.export_text()
    assert "…" not in text
    header = next(line for line in text.splitlines() if "manager" in line and "F1" in line)
    assert all(h in header for h in ("prec", "recall", "harmful", "parse fail", "peak ↓", "reads ↓"))
    assert "0.74" in text and "0.08" in text


def test_the_manager_stage_keeps_a_journal_in_its_folder(tmp_path):
    """A killed manager stage resumes trace by trace: its command journals into the stage's own (kept) folder."""
    from kvsteward.pipelines.pipeline import DONE, stages

    (manager,) = [s for s in stages(PipelineConfig()) if s.name == "manager"]
    train = tmp_path / "train"
    train.mkdir()
    (train / DONE).write_text('{"result": {"adapter_dir": "A"}}')
    args = manager.command(tmp_path / "manager-x", {"hindsight": tmp_path / "h", "train": train})
    assert args[args.index("--journal") + 1] == str(tmp_path / "manager-x" / "traces.jsonl")


def test_a_held_out_environment_is_never_trained_or_calibrated_on(tmp_path):
    """Leave-one-environment-out as stages: training, calibration and the baselines' fit see only the other
    environments; the held-out stage and the imported set test the held-out one; every recipe flag reaches its
    command."""
    from kvsteward.pipelines.pipeline import DONE, stages

    cfg = PipelineConfig(envs="research,ops,support", holdout_env="ops", train_minutes=30, lr=5e-4, pack=True)
    by = {s.name: s for s in stages(cfg)}
    assert list(by) == ["engine", "longsession", "residency", "traces", "hindsight", "train", "calibrate", "choose",
                        "manager", "heldout", "fresh_traces", "exported", "imported", "manager_imported", "serve"]
    train = tmp_path / "train"
    train.mkdir()
    (train / DONE).write_text('{"result": {"adapter_dir": "A"}}')
    up = {n: tmp_path / n for n in by} | {"train": train}

    def args(name):
        a = by[name].command(tmp_path / name, up)
        return {k: a[i + 1] for i, k in enumerate(a) if k.startswith("--") and i + 1 < len(a)}, a

    t, raw = args("train")
    assert t["--envs"] == "research,support" and t["--max-minutes"] == "30" and t["--lr"] == "0.0005"
    assert t["--adapter-scope"] == "aux" and t["--aux-context"] == "full" and "--skip-trivial" in raw
    assert "--pack" in args("hindsight")[1]
    c, _ = args("calibrate")
    assert c["--split"] == "validation" and c["--env"] == c["--fit-envs"] == "research,support"
    assert c["--rules"] == "delete_all_read,structure"  # played on the calibration's replays, read by choose
    ch, raw = args("choose")  # chosen on the calibration's validation traces, never on a test set
    assert ch["--split"] == "validation" and ch["--env"] == ch["--fit-envs"] == "research,support"
    assert ch["--calibration"] == str(tmp_path / "calibrate" / DONE) and ch["--limit"] == str(cfg.calibrate_traces)
    m, _ = args("manager")
    h, _ = args("heldout")
    assert m["--env"] == "research,support" and h["--env"] == "ops" and h["--split"] == "test"
    assert m["--fit-envs"] == h["--fit-envs"] == "research,support"
    assert args("fresh_traces")[0]["--env"] == "ops" and args("fresh_traces")[0]["--seed"] == "1"
    i, _ = args("manager_imported")
    assert i["--traces"] == str(tmp_path / "imported") and i["--split"] == "all"
    with pytest.raises(ValueError, match="not among --envs"):
        PipelineConfig(envs="research", holdout_env="ops").check()
    with pytest.raises(ValueError, match="no environment left"):
        PipelineConfig(envs="ops", holdout_env="ops").check()


@pytest.mark.parametrize("bench_arms, residency_arms, residency_length, separate", [
    ("full,h2o,pace", "full,pace", 0, False),  # the demo: the long-session stage's plays carry the trace
    ("full,h2o,pace", "full,h2o,pace", 2048, False),  # the same length, named
    ("h2o,pace", "full,h2o,pace", 0, True),  # full is not played by the long-session stage
    ("full,h2o,pace", "full", 8192, True),  # another length
    ("full,h2o,pace", "", 0, False),  # none asked
])
def test_the_residency_stage_runs_only_for_what_the_long_session_does_not_play(bench_arms, residency_arms,
                                                                               residency_length, separate):
    from kvsteward.pipelines.pipeline import stages

    cfg = PipelineConfig(bench_arms=bench_arms, bench_length=2048, residency_arms=residency_arms,
                         residency_length=residency_length)
    by = {s.name: s for s in stages(cfg)}
    assert ("residency" in by) is separate
    assert by["longsession"].params["resident_series"] is True  # its cache key changed with what it records


def test_a_scores_adapter_brings_the_stack_into_choose_and_every_manager_stage(tmp_path):
    from kvsteward.eval.manager.arms import ARM_NAMES
    from kvsteward.pipelines.pipeline import DONE, MANAGER_ARMS, STACK_HEAD, stages

    assert MANAGER_ARMS.split(",") == [a for a in ARM_NAMES if a != "stack"]  # `eval manager`'s default set
    plain = {s.name: s for s in stages(PipelineConfig(holdout_env="ops", envs="research,ops"))}
    assert "stack" not in plain["choose"].params["arms"] and "arms" not in plain["manager"].params
    cfg = PipelineConfig(holdout_env="ops", envs="research,ops", trigger="scores", stack_fit=7)
    by = {s.name: s for s in stages(cfg)}
    train = tmp_path / "train"
    train.mkdir()
    (train / DONE).write_text('{"result": {"adapter_dir": "A"}}')
    up = {n: tmp_path / n for n in by} | {"train": train}
    choose = by["choose"].command(tmp_path / "choose", up)
    assert choose[choose.index("--arms") + 1] == "delete_all_read,structure,adapter,stack"
    assert choose[choose.index("--stack-fit") + 1] == "7"
    assert choose[choose.index("--stack-head") + 1] == str(tmp_path / "choose" / STACK_HEAD)
    for name in ("manager", "heldout", "manager_imported"):
        assert "choose" in by[name].upstream
        cmd = by[name].command(tmp_path / name, up)
        assert cmd[cmd.index("--arms") + 1] == MANAGER_ARMS + ",stack"
        assert cmd[cmd.index("--stack-head") + 1] == str(tmp_path / "choose" / STACK_HEAD)


def test_the_end_summary_lists_stage_times_outputs_report_and_mlflow(tmp_path, monkeypatch):
    """What `steward pipeline run` prints last: every stage's wall time and outputs, the report, the MLflow runs and
    the command that opens the MLflow UI on the store."""
    from rich.console import Console

    import kvsteward.pipelines.cli_pipeline as cli

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////x/mlflow.db")
    monkeypatch.setattr(cli, "console", Console(width=200, record=True, file=io.StringIO()))
    (tmp_path / "serve-1").mkdir()
    (tmp_path / "serve-1" / "serve.json").write_text("{}")
    (tmp_path / "pipeline.json").write_text(json.dumps({"mlflow_run_id": "parent123"}))
    summary = {"serve": {"dir": str(tmp_path / "serve-1"), "cached": False, "wall_s": 75.0, "result": {}},
               "train": {"dir": str(tmp_path / "train-1"), "cached": True, "wall_s": 130.0,
                         "result": {"adapter_dir": "/a/adapter", "mlflow_run_id": "train456"}}}
    built = {"html": tmp_path / "report.html", "figures": {"serving": tmp_path / "serving.png"}, "wall_s": 4.0}
    cli._print_summary(summary, tmp_path, built, 400.0)
    text = cli.console.export_text()
    assert "1m15s" in text and "cached (2m10s when run)" in text and "6m40s" in text
    assert str(tmp_path / "serve-1" / "serve.json") in text and "/a/adapter" in text
    assert str(tmp_path / "report.html") in text and "serving.png" in text
    assert "parent123" in text and "train456" in text
    assert "ui --backend-store-uri sqlite:////x/mlflow.db" in text
    assert "SHIPPED reference" in text and "--seed 7" in text


def test_estimates_scale_by_the_last_run_of_the_stage(tmp_path):
    from kvsteward.pipelines.pipeline import _model_estimate, estimate, stages

    cfg = PipelineConfig()
    (train,) = [s for s in stages(cfg) if s.name == "train"]
    model = _model_estimate(train, cfg)
    assert estimate(train, cfg, {}) == model
    assert estimate(train, cfg, {"train": {"wall_s": 2 * model, "model_s": model}}) == pytest.approx(2 * model)


def test_the_bar_shows_a_stages_last_log_line(tmp_path):
    from kvsteward.pipelines.cli_pipeline import last_line

    log = tmp_path / "stage.log"
    log.write_text("Loading weights:  50%|##   | 1/2\rLoading weights: 100%|####| 2/2\n"
                   "[23:10:04] session 1/2 (D=256) full: forced_acc=1.00        runner.py:336\n\n")
    assert last_line(log, width=200).startswith("session 1/2 (D=256) full: forced_acc=1.00")
    log.write_text("train \x1b[32m━━━\x1b[0m 3/4 loss=1.6\r")
    assert last_line(log) == "train ━━━ 3/4 loss=1.6"
    assert last_line(None) == "" and last_line(tmp_path / "none") == ""


def test_a_run_reports_progress_and_leaves_its_index_and_timings(tmp_path):
    """With a progress sink, each stage's stderr goes to its folder's stage.log, the sink sees start (with an
    estimate) and finish, and the root gets pipeline.json (what `steward report` reads) and timings.json."""
    from kvsteward.pipelines.pipeline import StageProgress

    seen = []

    class Sink(StageProgress):
        def start(self, name, index, total, estimate_s, log_path):
            seen.append(("start", name, index, total, estimate_s > 0, log_path.name))

        def finish(self, name, wall_s, ok):
            seen.append(("finish", name, ok))

    stages = _stages(1)
    stages[0].command = lambda out, up: ["-c", "import sys, json; print('working', file=sys.stderr); print('{}')"]
    summary = run_pipeline(PipelineConfig(), tmp_path, log=lambda m: None, mlflow_log=False, stage_list=stages,
                           launcher=[sys.executable], progress=Sink())
    assert seen[:2] == [("start", "a", 0, 3, True, "stage.log"), ("finish", "a", True)] and len(seen) == 6
    assert (tmp_path / f"a-{summary['a']['hash']}" / "stage.log").read_text() == "working\n"
    index = json.loads((tmp_path / "pipeline.json").read_text())
    assert index["stages"] == {n: r["dir"] for n, r in summary.items()}
    assert set(json.loads((tmp_path / "timings.json").read_text())) == {"a", "b", "c"}
    assert all(r["cpu_s"] >= 0 for r in summary.values())
