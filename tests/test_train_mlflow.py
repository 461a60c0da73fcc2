"""`steward train lora --json` end to end on a tiny model: one MLflow run with params, per-step metrics, the dataset
input, the adapter as run artifacts, and a registered model version that downloads the same adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvsteward.models import tiny_model
from kvsteward.pipelines.cli import app
from kvsteward.train.toy import random_ids_dataset
from kvsteward.train.tracking import MODEL_NAME, default_tracking_uri, ensure_tracking

torch.set_num_threads(1)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTEWARD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "home"


def test_tracking_uri_defaults_to_data_dir_and_env_overrides(home, tmp_path, monkeypatch):
    assert default_tracking_uri() == f"sqlite:///{home.resolve()}/mlflow.db"
    other = f"sqlite:///{tmp_path}/other.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    assert default_tracking_uri() == other


def test_cli_run_is_fully_tracked(home, tmp_path):
    import mlflow

    tiny_model().save_pretrained(tmp_path / "tiny")
    random_ids_dataset(rows=30).save_to_disk(str(tmp_path / "ds"))
    args = ["train", "lora", "--model", str(tmp_path / "tiny"), "--data", str(tmp_path / "ds"), "--max-steps", "4",
            "--out", str(tmp_path / "run"), "--json", "--rank", "4", "--alpha", "8", "--lambda-kl", "0.5",
            "--lr", "1e-2", "--save-steps", "2"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # the JSON alone on stdout
    assert set(out) >= {"mlflow_run_id", "adapter_dir", "final_ce_aux", "final_kl_main", "steps"}
    assert out["steps"] == 4 and isinstance(out["final_ce_aux"], float) and isinstance(out["final_kl_main"], float)
    adapter = Path(out["adapter_dir"])
    assert (adapter / "adapter_config.json").exists() and not (adapter / "training_args.bin").exists()

    assert ensure_tracking() == f"sqlite:///{home.resolve()}/mlflow.db"
    client = mlflow.MlflowClient()
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((home / "mlartifacts").resolve().as_uri())
    p = run.data.params
    assert (p["rank"], p["alpha"], p["lambda_kl"], p["max_steps"], p["lr"]) == ("4", "8", "0.5", "4", "0.01")
    assert set(p["target_modules"].split(",")) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    for name in ("loss", "ce_aux", "kl_main", "learning_rate"):
        assert len(client.get_metric_history(run.info.run_id, name)) >= 2, name
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert client.get_metric_history(run.info.run_id, "ce_aux")[-1].value == pytest.approx(out["final_ce_aux"])

    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "ds:train" and json.loads(inp.dataset.profile)["num_rows"] == 24
    assert {t.key: t.value for t in inp.tags}["mlflow.data.context"] == "training"

    files = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= files

    (version,) = client.search_model_versions(f"name='{MODEL_NAME}'")
    assert version.run_id == run.info.run_id and version.source == f"runs:/{run.info.run_id}/adapter"
    fetched = Path(mlflow.artifacts.download_artifacts(f"models:/{MODEL_NAME}/{version.version}",
                                                       dst_path=str(tmp_path / "dl")))
    a, b = load_file(fetched / "adapter_model.safetensors"), load_file(adapter / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dataset_input_has_a_schema_when_a_column_holds_only_empty_lists(tmp_path, monkeypatch, caplog):
    """Per-boundary rows carry the packed-row columns as empty lists; mlflow alone cannot type such a column and
    logs no schema plus the whole column as a warning. The logged input must have a schema of the other columns."""
    import logging

    import mlflow
    from datasets import Dataset
    from mlflow.types import Schema

    from kvsteward.train.tracking import dataset_schema, log_dataset

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4]], "position_ids": [[], []], "is_aux": [True, False]})
    assert set(dataset_schema(ds).input_names()) == {"input_ids", "is_aux"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/ml.db")
    with caplog.at_level(logging.WARNING), mlflow.start_run() as run:
        log_dataset(ds, "rows:train", context="training")
    assert not [r for r in caplog.records if "schema" in r.getMessage()]
    (inp,) = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    schema = Schema.from_json(json.dumps(json.loads(inp.dataset.schema)["mlflow_colspec"]))
    assert set(schema.input_names()) == {"input_ids", "is_aux"}
    assert {t.key: t.value for t in inp.tags}["mlflow.data.context"] == "training"


def test_the_pipeline_attaches_card_audit_and_evaluations_to_the_adapter_run(home, tmp_path):
    """What a reader of the registered adapter needs beside the weights: the dataset card (with its audit) and every
    evaluation of the pipeline, as artifacts of the adapter's training run."""
    import mlflow

    from kvsteward.pipelines.pipeline import attach_to_adapter_run

    ensure_tracking()
    with mlflow.start_run() as run:
        pass
    ds = tmp_path / "hindsight" / "ds"
    ds.mkdir(parents=True)
    (ds / "card.json").write_text(json.dumps({"audit": {"baselines": {"delete_all_read": {"f1": 0.6}}}}))
    (ds / "README.md").write_text("# card\n")
    summary = {"train": {"result": {"mlflow_run_id": run.info.run_id}}, "hindsight": {"dir": str(tmp_path /
                                                                                               "hindsight")},
               "manager": {"result": {"adapter": {"f1": 0.7}}}, "heldout": {"result": {"adapter": {"f1": 0.5}}}}
    assert attach_to_adapter_run(summary) == run.info.run_id
    client = mlflow.MlflowClient()
    names = {a.path for a in client.list_artifacts(run.info.run_id, "card")} | \
        {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert names == {"card/card.json", "card/README.md", "evaluation/manager.json", "evaluation/heldout.json"}
    got = json.loads(Path(client.download_artifacts(run.info.run_id, "evaluation/heldout.json", str(tmp_path)))
                     .read_text())
    assert got == {"adapter": {"f1": 0.5}}
    assert attach_to_adapter_run({"train": {"result": {}}}) is None  # an untracked training run: nothing to attach
