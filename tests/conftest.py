"""Shared fixtures: a real Valkey (or Redis) server for the tier tests, SmolLM2's tokenizer, a tiny model folder,
the manager evaluation's tiny engine and traces, a long-session result compared without its wall times."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def valkey_url(tmp_path_factory):
    """A real Valkey (or Redis, where Debian has no valkey) server on loopback, started for these tests."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        pytest.skip("no valkey-server / redis-server binary (.ci/run installs one)")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("valkey"))], stdout=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"valkey://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tok():
    """SmolLM2's tokenizer (the embedded model's), loaded once for every test module that tokenizes chat."""
    from kvsteward.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama saved with SmolLM2's tokenizer: a model folder the CLI loads in seconds."""
    from kvsteward.models import load_tokenizer, tiny_model

    tok = load_tokenizer("smollm2")
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", seed=3, vocab=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def manager_setup():
    """A tiny random Llama engine (SmolLM2's tokenizer) and two generated traces with at least 4 cursors each: the
    manager evaluation's hand-checkable setting."""
    from kvsteward.models import load_tokenizer, tiny_model
    from kvsteward.serve.engine import Engine
    from kvsteward.synth.traces.generate import generate_traces

    tok = load_tokenizer("smollm2")
    engine = Engine(tiny_model("llama", vocab=len(tok), seed=2), tok)
    traces = [t for t in generate_traces(6, seed=5) if len(t.cursors()) >= 4][:2]
    assert traces
    return engine, traces


@pytest.fixture(autouse=True)
def _mlflow_state_isolated():
    """MLflow keeps the tracking / registry URI and the active experiment in module globals and mirrors them into
    MLFLOW_* variables (set_experiment exports MLFLOW_EXPERIMENT_ID; set_registry_uri(None) does not unset its
    variable): every test starts from the environment it found, so no test reads another's store or experiment."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    if "mlflow" in sys.modules:  # never import it just for this
        import mlflow
        from mlflow.tracking import fluent

        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
        fluent._active_experiment_id = None
    for k in [k for k in os.environ if k.startswith("MLFLOW_")]:
        del os.environ[k]
    os.environ.update(env)


def _result_text(result: dict) -> str:
    def still(rec: dict) -> dict:
        out = {k: v for k, v in rec.items() if k != "wall_s"}
        if "resident_series" in out:
            series = out["resident_series"]
            out["resident_series"] = {**series, "points": [{k: v for k, v in p.items() if k != "wall_s"}
                                                           for p in series["points"]]}
        return out

    return json.dumps({arm: still(rec) for arm, rec in result["arms"].items()},
                      sort_keys=True)  # NaN (no code probes) compares equal as text


@pytest.fixture
def result_text():
    """A long-session result's arms as text without wall times (they differ between runs; the resident series
    records them too): two runs that played the same compare equal."""
    return _result_text
