"""Where kvsteward keeps its data (converted models, MLflow store, caches), and the interpreters of the side
virtualenvs the checkout builds (`.venv-sglang`, `.venv-kvpress`)."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """`$KVSTEWARD_HOME`, else `~/.cache/kvsteward`. Always absolute (MLflow's sqlite URIs need that)."""
    root = Path(os.environ.get("KVSTEWARD_HOME", Path.home() / ".cache" / "kvsteward")).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


REPO = Path(__file__).resolve().parents[1]  # the checkout (an editable install): where the side virtualenvs live


def side_python(env_var: str, venv: str, make_target: str, needs: str) -> str:
    """The interpreter of a side virtualenv (a peer pinning other versions than the project's): `$env_var`, else the
    checkout's `venv`, built by `make <make_target>`; `needs` names what it must have installed."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    candidate = REPO / venv / "bin" / "python"
    if not candidate.exists():
        raise FileNotFoundError(f"no {venv} virtualenv at {candidate}: run `make {make_target}` (or set {env_var} "
                                f"to an interpreter with {needs} installed)")
    return str(candidate)
