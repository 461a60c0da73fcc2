"""`steward report RUN_DIR`: the page and its figures exist and carry the run's numbers, and land in MLflow."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvsteward.pipelines.report import build_report, figure_data, load_run, manager_rows


def _arm(f1, precision, recall, deleted, harmful):
    return {"f1": f1, "precision": precision, "recall": recall, "deleted": deleted, "harmful": harmful,
            "harmful_rate": harmful / deleted, "harmful_rate_ci95": [0.1, 0.6]}


LONG = {"config": {"budget": 512, "chunk": 256, "limit": 1024}, "reference": "h2o",
        "arms": {arm: {"by_distance": {d: {"forced_acc": acc, "gold_nll": 0.5, "recall": 0.0, "residency": 1.0,
                                           "rotary_gap": 300.0, "n": 30} for d, acc in cells.items()},
                       "peak_resident_slots": peak, "wall_s": 12.5}
                 for arm, cells, peak in (("full", {"1024": 1.0, "7000": 0.1}, 8567),
                                          ("h2o", {"1024": 0.0, "7000": 0.0}, 768),
                                          ("pace", {"1024": 0.67, "7000": 0.7}, 768),
                                          ("pace-refresh", {"1024": 0.9, "7000": 0.97}, 768))},
        "paired": {"pace": {"better": 40, "worse": 0, "tied": 20, "p": 1e-12}}}
RESIDENCY = {"budget": 512, "chunk": 256, "limit": 1024,
             "series": {"full": [{"tokens": t, "resident": t, "kv_bytes": t * 46080} for t in (1000, 2000, 4000)],
                        "h2o": [{"tokens": t, "resident": min(t, 768), "kv_bytes": min(t, 768) * 46080}
                                for t in (1000, 2000, 4000)]}}
MANAGER = {"n_traces": 6, "arms": ["delete_all_read", "structure", "adapter"],
           "delete_all_read": _arm(0.618, 0.447, 1.0, 284, 157), "structure": _arm(0.7, 0.6, 0.84, 100, 40),
           "adapter": _arm(0.4321, 0.5, 0.38, 50, 25)}
SERVE = {"command": "steward serve --model smollm2", "turns": [
    {"name": "turn (whole cache)", "prompt_tokens": 688, "resident_tokens": 684, "next_position": 684,
     "reused_tokens": 0, "latency_s": 3.5, "prefix_match": "miss", "reply": "port 8080"},
    {"name": "drop + reposition", "cache": {"drop": {"3": [2]}, "reposition": [3]}, "prompt_tokens": 688,
     "resident_tokens": 102, "next_position": 102, "reused_tokens": 666, "latency_s": 0.6, "prefix_match": "exact",
     "reply": "port 8080"}]}
ENGINE = {"generate_equivalence": True, "op_max_abs_logit_err": {"drop": 1.5e-5, "reposition": 2.5e-5},
          "rerotation_max_abs_err": {"llama": 3e-7}, "renumber_500_max_abs_err": 4e-7,
          "renumber_500_chained_max_abs_err": 2e-4, "budget_peak_slots": 768, "budget": 512, "chunk": 256,
          "budget_tokens": 2048}


def _run(tmp_path, stages=None, index=True):
    stages = stages or {"engine": ENGINE, "longsession": LONG, "residency": RESIDENCY, "manager": MANAGER,
                        "heldout": dict(MANAGER, adapter=_arm(0.3333, 0.4, 0.3, 20, 12)), "serve": SERVE}
    dirs = {}
    for name, result in stages.items():
        d = tmp_path / f"{name}-abc123"
        d.mkdir()
        (d / "stage.json").write_text(json.dumps({"stage": name, "dir": str(d), "wall_s": 1.0, "result": result}))
        dirs[name] = str(d)
    if index:
        (tmp_path / "pipeline.json").write_text(json.dumps({"stages": dirs, "mlflow_run_id": None}))
    return tmp_path


def test_report_renders_every_figure_with_the_runs_numbers(tmp_path):
    built = build_report(_run(tmp_path), mlflow_log=False)
    assert set(built["figures"]) == {"accuracy_vs_distance", "resident_kv", "manager_arms", "serving"}
    for p in built["figures"].values():
        assert p.is_file() and p.stat().st_size > 5000 and p.parent == tmp_path
    data = figure_data(built["figures"]["accuracy_vs_distance"])
    acc = {(r["arm"], r["distance"]): r for r in data["run"]}
    assert acc[("pace-refresh", 7000)]["forced_acc"] == 0.97 and acc[("full", 7000)]["forced_acc"] == 0.1
    lo, hi = acc[("pace", 1024)]["ci95"]
    assert lo < 0.67 < hi and acc[("pace", 1024)]["n"] == 30
    # beside it, the shipped 8K reference with its numbers: the full cache loses the far definitions, pace keeps them
    ref = {(r["arm"], r["distance"]): r["forced_acc"] for r in data["reference"]}
    assert ref[("full", 7000)] == 0.0 and ref[("pace", 7000)] == pytest.approx(0.7) and ref[("h2o", 1024)] == 0.0
    res = figure_data(built["figures"]["resident_kv"])
    assert [p["resident"] for p in res["h2o"]] == [768, 768, 768] and res["full"][-1]["resident"] == 4000
    man = figure_data(built["figures"]["manager_arms"])
    assert set(man) == {"manager", "heldout"}
    adapter = next(r for r in man["manager"] if r["arm"] == "adapter")
    assert adapter["served"] and adapter["f1"] == pytest.approx(0.4321)
    assert adapter["f1_ci95"][0] < 0.4321 < adapter["f1_ci95"][1]
    assert next(r for r in man["heldout"] if r["arm"] == "adapter")["f1"] == pytest.approx(0.3333)
    serving = figure_data(built["figures"]["serving"])
    assert [t["resident_tokens"] for t in serving] == [684, 102]
    page = built["html"].read_text()
    for needle in ("0.432", "0.333", "0.970", "8567", "684", "102", "LoRA manager (served)", "data:image/png;base64",
                   "Engine exactness", "port 8080", "not run by this demo", "--seed 7"):
        assert needle in page, needle


def test_the_report_marks_the_manager_the_choose_stage_serves(tmp_path):
    """With a `choose` stage the served (red, labelled) arm is its winner, not the adapter, and the page names the
    folder `steward serve --manager` takes."""
    choose = {"choice": "structure", "reason": "best validation F1: structure 0.700 (vs adapter 0.600)",
              "manager_dir": "runs/x/choose-1/manager"}
    built = build_report(_run(tmp_path, {"manager": MANAGER, "choose": choose}), mlflow_log=False)
    rows = figure_data(built["figures"]["manager_arms"])["manager"]
    assert [r["arm"] for r in rows if r["served"]] == ["structure"]
    page = built["html"].read_text()
    assert "structure (trees) (served)" in page and "LoRA manager (served)" not in page
    assert "steward serve --manager runs/x/choose-1/manager" in page and "structure 0.700" in page


def test_without_a_residency_stage_the_plot_reads_the_long_sessions_own_plays(tmp_path):
    """The demo has no residency stage: each arm's `resident_series` in the long-session result is what the
    resident-KV figure draws, with the arm's peak and the run's B, H, L."""
    series = {"full": [1000, 2000, 4000], "pace": [768, 700, 768]}
    arms = {arm: dict(LONG["arms"][arm], resident_series={"session": "s0", "points": [
        {"tokens": t, "resident": r, "kv_bytes": r * 46080} for t, r in zip((1000, 2000, 4000), rs, strict=True)]})
            for arm, rs in series.items()}
    built = build_report(_run(tmp_path, {"longsession": dict(LONG, arms=dict(LONG["arms"], **arms))}),
                         mlflow_log=False)
    res = figure_data(built["figures"]["resident_kv"])
    assert set(res) == {"full", "pace"}
    assert [p["resident"] for p in res["pace"]] == [768, 700, 768] and res["full"][-1]["kv_mib"] == 4000 * 46080 / 2**20
    assert "Resident KV vs session length" in built["html"].read_text()


def test_report_reads_the_newest_stages_without_an_index_and_skips_what_is_missing(tmp_path):
    _run(tmp_path, {"longsession": LONG}, index=False)
    assert set(load_run(tmp_path)) == {"longsession"}
    built = build_report(tmp_path, mlflow_log=False)
    assert set(built["figures"]) == {"accuracy_vs_distance"}
    with pytest.raises(ValueError, match="no finished pipeline stage"):
        build_report(tmp_path / "nothing-here", mlflow_log=False)


def test_manager_rows_recover_counts_and_intervals():
    (row,) = manager_rows({"arms": ["adapter"], "adapter": _arm(0.5, 0.5, 0.5, 40, 20)})
    assert (row["tp"], row["fp"], row["fn"]) == (20, 20, 20)
    assert row["f1_ci95"][0] < 0.5 < row["f1_ci95"][1] and row["harmful_rate_ci95"] == [0.1, 0.6]


def test_steward_report_logs_the_page_to_the_pipelines_mlflow_run(tmp_path, monkeypatch):
    import mlflow

    from kvsteward.pipelines.cli import app
    from kvsteward.train.tracking import ensure_tracking

    monkeypatch.setenv("KVSTEWARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/ml.db")
    ensure_tracking()
    with mlflow.start_run(run_name="pipeline") as run:
        pass
    root = _run(tmp_path / "run" if (tmp_path / "run").mkdir() is None else None)
    index = json.loads((root / "pipeline.json").read_text())
    (root / "pipeline.json").write_text(json.dumps(index | {"mlflow_run_id": run.info.run_id}))
    result = CliRunner().invoke(app, ["report", str(root)])
    assert result.exit_code == 0, result.output
    assert "report.html" in result.output
    names = {f.path for f in mlflow.MlflowClient().list_artifacts(run.info.run_id, "report")}
    assert {"report/report.html", "report/manager_arms.png", "report/accuracy_vs_distance.png"} <= names
