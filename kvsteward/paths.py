"""Where kvsteward keeps its data (converted models, MLflow store, caches)."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """`$KVSTEWARD_HOME`, else `~/.cache/kvsteward`. Always absolute (MLflow's sqlite URIs need that)."""
    root = Path(os.environ.get("KVSTEWARD_HOME", Path.home() / ".cache" / "kvsteward")).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root
