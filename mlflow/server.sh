#!/usr/bin/env bash
# Run an MLflow tracking server on kvsteward's store (see mlflow/README.md).
#
# Local default: the sqlite database and artifact folder that `steward train lora` writes to when
# MLFLOW_TRACKING_URI is unset (<data dir>/mlflow.db, <data dir>/mlartifacts; data dir = $KVSTEWARD_HOME or
# ~/.cache/kvsteward). At scale, point it at Postgres + object storage:
#   BACKEND_STORE_URI=postgresql://mlflow:PASSWORD@db-host:5432/mlflow \
#   ARTIFACTS_DESTINATION=s3://my-bucket/kvsteward MLFLOW_HOST=0.0.0.0 mlflow/server.sh --workers 4
# Extra arguments are passed to `mlflow server`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
DATA_DIR="$("$PY" -c 'from kvsteward.paths import data_dir; print(data_dir())')"

BACKEND="${BACKEND_STORE_URI:-sqlite:///$DATA_DIR/mlflow.db}"
ARTIFACTS="${ARTIFACTS_DESTINATION:-$DATA_DIR/mlartifacts}"
HOST="${MLFLOW_HOST:-127.0.0.1}"   # localhost only unless asked: the server has no authentication by default
PORT="${MLFLOW_PORT:-5000}"

echo "mlflow server: backend=$BACKEND artifacts=$ARTIFACTS http://$HOST:$PORT" >&2
exec "$PY" -m mlflow server --backend-store-uri "$BACKEND" --artifacts-destination "$ARTIFACTS" \
  --host "$HOST" --port "$PORT" "$@"
