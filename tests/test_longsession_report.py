"""Report writing (JSON, Markdown, plots) and MLflow logging of long-session results."""

from __future__ import annotations

import json

import pytest

from kvsteward.eval.longsession.report import flat_metrics, log_to_mlflow, markdown, write_report


def _cell(acc, res, gap, n=15):
    return {"forced_acc": acc, "gold_nll": 1.5, "recall": 0.25, "residency": res, "rotary_gap": gap, "n": n}


RESULT = {
    "arms": {
        "h2o": {"by_distance": {"1024": _cell(0.4, 0.5, 900.0), "8192": _cell(0.0, 0.0, float("nan"))},
                "peak_resident_slots": 512, "wall_s": 12.5},
        "pace": {"by_distance": {"1024": _cell(0.8, 1.0, 700.0), "8192": _cell(0.6, 0.95, 1500.0)},
                 "peak_resident_slots": 512, "wall_s": 13.0},
    },
    "paired": {"pace": {"better": 9, "worse": 1, "tied": 20, "p": 0.021484375}},
    "reference": "h2o",
}


def test_write_report_files(tmp_path):
    paths = write_report(RESULT, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["arms"]["h2o"]["by_distance"]["8192"]["rotary_gap"] is None  # NaN written as null
    assert data["arms"]["pace"]["by_distance"]["8192"]["forced_acc"] == 0.6
    md = paths["markdown"].read_text()
    assert "| pace | 0.800 | 0.600 | 512 | 13.0 |" in md
    assert "| h2o | 8192 | 15 | 0.000 | 1.500 | 0.250 | 0.000 | – |" in md
    assert "| pace | 9 | 1 | 20 | 0.0215 |" in md and "Paired against h2o" in md
    for key in ("distance_plot", "gap_plot"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_distances_sort_numerically():
    result = {"arms": {"a": {"by_distance": {"15000": _cell(0.1, 1, 1.0), "1024": _cell(0.9, 1, 1.0)}}}}
    assert markdown(result).index("D=1024") < markdown(result).index("D=15000")


def test_bad_result_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="lacks"):
        write_report({"arms": {"a": {"by_distance": {"1024": {"forced_acc": 1.0}}}}}, tmp_path)
    with pytest.raises(ValueError, match="non-empty 'arms'"):
        write_report({}, tmp_path)


def test_flat_metrics_names_and_skips_nan():
    m = flat_metrics(RESULT)
    assert m["pace.d8192.forced_acc"] == 0.6 and m["h2o.d1024.rotary_gap"] == 900.0
    assert "h2o.d8192.rotary_gap" not in m
    assert m["paired.pace.p"] == 0.021484375 and m["h2o.wall_s"] == 12.5


def test_log_to_mlflow_default_local_store(tmp_path, monkeypatch):
    import mlflow

    from kvsteward.eval.tracking import ensure_tracking

    home = tmp_path / "home"
    monkeypatch.setenv("KVSTEWARD_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset")  # so that undo removes what mlflow exports there
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    out = tmp_path / "out"
    write_report(RESULT, out)
    run_id = log_to_mlflow(RESULT, out, {"length": 16384, "budget": 512})
    assert ensure_tracking() == f"sqlite:///{home.resolve() / 'mlflow.db'}"
    run = mlflow.get_run(run_id)
    assert run.data.metrics["pace.d1024.forced_acc"] == 0.8
    assert run.data.params["budget"] == "512"
    assert run.info.artifact_uri.startswith((home.resolve() / "mlartifacts").as_uri())
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run_id)}
    assert {"report.md", "results.json", "acc_vs_distance.png", "acc_vs_rotary_gap.png"} <= names


def test_per_fact_breakdown_counts_answers_and_names_the_wrong_ones():
    """`summarize` gives each fact kind its answered / played and the wrong answers by count (the text up to the
    closing quote); the report prints them."""
    from kvsteward.eval.longsession.runner import ProbeRow, RunConfig, summarize

    def row(session, probe, score, text):
        return ProbeRow(session, 1024, "pace", probe, "fact", score, extra={"generated": text})

    rows = [row("s1", "fact:quantum", 0.0, '0.00")'), row("s2", "fact:quantum", 0.0, '1.50")\nFEE'),
            row("s3", "fact:quantum", 0.0, '0.00")'), row("s4", "fact:quantum", 1.0, '0.05")'),
            row("s1", "fact:fee_rate", 1.0, '0.0559")')]
    result = summarize(rows, {}, {}, RunConfig(arms=("pace",), code=False))
    facts = result["arms"]["pace"]["by_distance"]["1024"]["by_fact"]
    assert facts["fact:quantum"] == {"forced_acc": 0.25, "answered": 1, "n": 4, "misses": {"0.00": 2, "1.50": 1}}
    assert facts["fact:fee_rate"]["misses"] == {} and facts["fact:fee_rate"]["answered"] == 1
    text = markdown(result)
    assert "| pace | 1024 | quantum | 1/4 | `0.00` ×2, `1.50` ×1 |" in text
