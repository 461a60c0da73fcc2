"""MLflow tracking defaults: a local sqlite store under `data_dir()` unless `MLFLOW_TRACKING_URI` says otherwise."""

from __future__ import annotations

import os

from kvsteward.paths import data_dir

DEFAULT_EXPERIMENT = "kvsteward"
_SERVER_SCHEMES = ("http://", "https://", "databricks")


def default_tracking_uri() -> str:
    return f"sqlite:///{data_dir() / 'mlflow.db'}"


def ensure_tracking(experiment: str = DEFAULT_EXPERIMENT) -> str:
    """Point MLflow at `$MLFLOW_TRACKING_URI` (else the local sqlite store) and select `experiment`, creating it
    with artifacts under `<data_dir()>/mlartifacts/<experiment>` when the local store is used. Returns the URI."""
    import mlflow

    uri = os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        # A tracking server chooses its own artifact store; a store opened directly (sqlite, a database, a folder)
        # would otherwise put artifacts under ./mlruns of whatever the working directory is.
        location = None if uri.startswith(_SERVER_SCHEMES) else (data_dir() / "mlartifacts" / experiment).as_uri()
        mlflow.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment)
    return uri
