"""Shared fixtures: a real Valkey (or Redis) server for the tier tests, SmolLM2's tokenizer, a tiny model folder."""

from __future__ import annotations

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
