"""MLflow runs of pipeline stages: nested under the pipeline's parent run when one is named in the environment."""

from __future__ import annotations

import os
from contextlib import contextmanager

PARENT_ENV = "KVSTEWARD_PARENT_RUN"  # set by `steward pipeline run` for every stage process


def parent_run_id() -> str | None:
    return os.environ.get(PARENT_ENV) or None


@contextmanager
def stage_run(name: str):
    """The active run if there is one; else a new run in the project's store, nested under the pipeline's parent
    run when `KVSTEWARD_PARENT_RUN` is set."""
    import mlflow

    from kvsteward.train.tracking import ensure_tracking

    active = mlflow.active_run()
    if active is not None:
        yield active
        return
    ensure_tracking()
    with mlflow.start_run(run_name=name, parent_run_id=parent_run_id()) as run:
        yield run
