"""MLflow tracking for kvsteward: store location, runs that survive `--resume`, dataset inputs, adapter registration.

Default store: `MLFLOW_TRACKING_URI` if set, else `sqlite:///<data_dir>/mlflow.db` with artifacts under
`<data_dir>/mlartifacts/<experiment>` (absolute: MLflow 3's own default is a sqlite file relative to the working
directory). See mlflow/README.md for running a server on the same store, or on Postgres + object storage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvsteward.paths import data_dir

MODEL_NAME = "kvsteward-memory-manager"
RUN_FILE = "mlflow_run.json"


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{data_dir() / 'mlflow.db'}"


_SERVER_SCHEMES = ("http://", "https://", "databricks")


def _artifact_location(uri: str, experiment: str) -> str | None:
    if uri.startswith(_SERVER_SCHEMES):
        return None
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts" / experiment).as_uri()
    return (data_dir() / "mlartifacts" / experiment).as_uri()


def ensure_tracking(experiment: str = "kvsteward") -> str:
    """Point MLflow at the project's store, create/select `experiment`, and return the tracking URI.

    A new experiment on a sqlite store (the default) keeps its artifacts next to the database, in
    `<db folder>/mlartifacts/<experiment>`; on another directly opened database under `<data_dir>/mlartifacts`
    (MLflow's own default would be `./mlruns` of whatever the working directory is); on a server, where the server
    decides (`--artifacts-destination`).
    """
    import mlflow

    uri = default_tracking_uri()
    mlflow.set_tracking_uri(uri)  # note: MLflow also exports it as MLFLOW_TRACKING_URI for child processes
    if mlflow.get_experiment_by_name(experiment) is None:
        mlflow.create_experiment(experiment, artifact_location=_artifact_location(uri, experiment))
    mlflow.set_experiment(experiment)
    return uri


def start_run(out_dir: Path, resume: bool, run_name: str | None = None):
    """Start the training's MLflow run, or reopen the one recorded in `out_dir` when resuming (one run per training).

    Nested under the pipeline's parent run when `steward pipeline run` names one (`KVSTEWARD_PARENT_RUN`). The run id
    is written to `out_dir/mlflow_run.json` so that a resumed process finds it.
    """
    import mlflow

    from kvsteward.runs import parent_run_id

    record = out_dir / RUN_FILE
    if resume and record.exists():
        run_id = json.loads(record.read_text())["run_id"]
        return mlflow.start_run(run_id=run_id)
    run = mlflow.start_run(run_name=run_name, parent_run_id=parent_run_id())
    out_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": mlflow.get_tracking_uri()}))
    return run


def log_params_once(params: dict) -> None:
    """Log params; on a resumed run keep the first values (MLflow params are immutable) and tag the new ones."""
    import mlflow

    run = mlflow.active_run()
    have = mlflow.get_run(run.info.run_id).data.params
    fresh = {k: v for k, v in params.items() if k not in have}
    changed = {f"resume.{k}": str(v)[:5000] for k, v in params.items() if k in have and have[k] != str(v)}
    if fresh:
        mlflow.log_params(fresh)
    if changed:
        mlflow.set_tags(changed)


def log_dataset(ds, name: str, source: str | None = None, context: str = "training") -> None:
    """Record a dataset split as an input of the active run (digest, schema, row count)."""
    import warnings

    import mlflow
    import mlflow.data

    # Noise silenced: a local path "can be interpreted in multiple ways" (all LocalArtifact), and the schema hint
    # about integer columns (token ids never go missing).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dataset = mlflow.data.from_huggingface(ds, source=source, name=name)
        dataset.__dict__["schema"] = dataset_schema(ds)  # fills mlflow's cached_property before it infers its own
        mlflow.log_input(dataset, context=context)


def dataset_schema(ds, rows: int = 10_000):
    """The MLflow schema of `ds` (its first `rows` rows), leaving out list columns that are empty in all of them.

    mlflow infers the schema itself, but it cannot type a column of empty lists (the packed-row columns such as
    `position_ids` on per-boundary rows) and then logs the whole pandas column as a multi-kilobyte warning and no
    schema at all. Such a column carries nothing, so it is left out of the schema (the digest still covers it)."""
    # mlflow's own inference routine (private, but the one its HF dataset uses): from_huggingface takes no schema.
    from mlflow.types.utils import _infer_schema

    df = ds.select(range(min(rows, ds.num_rows))).to_pandas()
    empty = [c for c in df.columns if df[c].dtype == object and len(df) and df[c].map(
        lambda v: hasattr(v, "__len__") and not isinstance(v, str) and len(v) == 0).all()]
    try:
        return _infer_schema(df.drop(columns=empty))
    except Exception:  # noqa: BLE001 -- a schema is optional metadata; the input is logged without one, as mlflow does
        return None


def log_adapter(adapter_dir: Path, register: bool = True, name: str = MODEL_NAME):
    """Upload the adapter folder as run artifacts under `adapter/` and register it as a model version.

    `mlflow.register_model("runs:/<id>/adapter")` refuses in MLflow 3 unless the folder is an MLflow model (MLmodel
    file) or a LoggedModel exists, and a PEFT adapter is neither; the registry's own call,
    `MlflowClient.create_model_version(source="runs:/<id>/adapter", run_id=...)`, registers the run artifacts as is
    (`models:/kvsteward-memory-manager/<version>` then downloads the adapter folder).
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    mlflow.log_artifacts(str(adapter_dir), artifact_path="adapter")
    if not register:
        return None
    run_id = mlflow.active_run().info.run_id
    client = mlflow.MlflowClient()
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    return client.create_model_version(name, source=f"runs:/{run_id}/adapter", run_id=run_id)
