"""`steward train lora` tracked against a real `mlflow server` (issue 30): the run, its params, metrics and dataset
input, the adapter artifacts and the registered model version all live on the server, and the artifact files were
uploaded to the server's `--artifacts-destination` (the client writes none locally)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kvsteward.models import tiny_model
from kvsteward.pipelines.cli import app
from kvsteward.train.toy import random_ids_dataset
from kvsteward.train.tracking import MODEL_NAME

torch.set_num_threads(1)
_START_TIMEOUT_S = 60


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real tracking server (sqlite backend, proxied artifacts) on a free loopback port, killed afterwards."""
    root = tmp_path_factory.mktemp("mlflow-server")
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    if not mlflow_bin.exists():
        pytest.skip(f"no mlflow executable next to {sys.executable}")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [str(mlflow_bin), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT,
        # no background job runner (online scoring, trace archival): nothing here uses it, and it costs CPU
        env={**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})

    def stop():
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()

    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            pytest.fail(f"mlflow server did not come up within {_START_TIMEOUT_S}s (exit {proc.returncode}):\n"
                        + (root / "server.log").read_text()[-3000:])
        time.sleep(0.5)
    yield {"url": url, "root": root}
    stop()


def test_training_is_tracked_on_a_real_server(server, tmp_path, monkeypatch):
    import mlflow

    url, root = server["url"], server["root"]
    home = tmp_path / "home"
    monkeypatch.setenv("KVSTEWARD_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.chdir(tmp_path)  # a client-side ./mlruns or ./mlartifacts would show up here
    tiny_model().save_pretrained(tmp_path / "tiny")
    random_ids_dataset(rows=30).save_to_disk(str(tmp_path / "ds"))
    args = ["train", "lora", "--model", str(tmp_path / "tiny"), "--data", str(tmp_path / "ds"), "--max-steps", "4",
            "--out", str(tmp_path / "run"), "--json", "--rank", "4", "--alpha", "8", "--lr", "1e-2",
            "--save-steps", "2"]
    try:
        res = CliRunner().invoke(app, args)
    finally:
        mlflow.set_tracking_uri(None)  # the CLI set it process-wide: leave later tests their own store
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    adapter = Path(out["adapter_dir"])

    client = mlflow.MlflowClient(tracking_uri=url, registry_uri=url)
    run = client.get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "kvsteward"
    # artifacts proxied by the server: the run's artifact URI is the server's, not a local path
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
    p = run.data.params
    assert (p["rank"], p["alpha"], p["max_steps"], p["lr"]) == ("4", "8", "4", "0.01")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert client.get_metric_history(run.info.run_id, "ce_aux")[-1].value == pytest.approx(out["final_ce_aux"])
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "ds:train" and json.loads(inp.dataset.profile)["num_rows"] == 24

    files = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= files
    # the bytes are in the server's artifact destination ...
    (stored,) = (root / "artifacts").rglob(f"{run.info.run_id}/artifacts/adapter/adapter_model.safetensors")
    a, b = load_file(stored), load_file(adapter / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # ... and nowhere the client would have written them itself
    assert not (home / "mlartifacts").exists() and not (home / "mlflow.db").exists()
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlartifacts").exists()

    (version,) = client.search_model_versions(f"name='{MODEL_NAME}'")
    assert version.run_id == run.info.run_id and version.source == f"runs:/{run.info.run_id}/adapter"
    mlflow.set_tracking_uri(url)
    mlflow.set_registry_uri(url)
    try:
        fetched = Path(mlflow.artifacts.download_artifacts(f"models:/{MODEL_NAME}/{version.version}",
                                                           dst_path=str(tmp_path / "dl")))
    finally:
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
    c = load_file(fetched / "adapter_model.safetensors")
    assert c.keys() == b.keys() and all(torch.equal(c[k], b[k]) for k in c)
