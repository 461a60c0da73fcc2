"""Storage tiers: a state moved through host → disk → Valkey/Redis comes back bit for bit and continues identically."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from kvsteward.models import tiny_model
from kvsteward.serve.engine import Engine
from kvsteward.serve.tiers import DiskTier, HostTier, TieredStore, ValkeyTier, load_snapshot, snapshot

torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama", seed=8))


def _session(engine):
    s = engine.session("pace", budget=24, chunk=8, limit=48, blueprint=[{"span": [0, 4], "readers": [5]}])
    for i in range(6):
        s.append(torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(i)).tolist(),
                 kind="tool" if i % 2 else "user")
    s.drop(s.resident_logical()[5:7].tolist())
    assert s.renumbers > 0 and s.table.ref_k is not None
    return s


def _same(a, b):
    n = a.table.n
    assert n == b.table.n and a.history == b.history and a.tokens == b.tokens and a.status == b.status
    assert (a.next_pos, a.n_messages, a.current_step) == (b.next_pos, b.n_messages, b.current_step)
    for i in range(a.table.n_layers):
        assert torch.equal(a.table.k[i][:, :n], b.table.k[i][:, :n])
        assert torch.equal(a.table.v[i][:, :n], b.table.v[i][:, :n])
        assert torch.equal(a.table.ref_k[i][:, :n], b.table.ref_k[i][:, :n])
    for name in a.table.meta:
        assert torch.equal(a.table.field(name), b.table.field(name)), name
    assert torch.equal(a.last_logits, b.last_logits)


def test_snapshot_round_trip_is_bit_exact_and_continues_identically(engine):
    s = _session(engine)
    r = load_snapshot(engine, s.config, snapshot(s))
    _same(s, r)
    nxt = [3, 1, 4, 1, 5]
    assert torch.equal(r.append(nxt, logits="all"), s.append(nxt, logits="all"))
    assert r.resident_logical().tolist() == s.resident_logical().tolist()


def test_demote_through_every_tier_and_fetch_back(engine, tmp_path, valkey_url):
    s = _session(engine)
    store = TieredStore([HostTier(), DiskTier(tmp_path / "disk"), ValkeyTier(valkey_url)])
    store.put("sess-1", s)
    assert store.where("sess-1") == 0
    assert store.demote("sess-1") == 1 and store.demote("sess-1") == 2 and store.demote("sess-1") == 2
    assert store.tiers[0].get("sess-1") is None and store.tiers[1].get("sess-1") is None
    got = store.fetch("sess-1", engine, s.config)
    assert got.tier == "valkey" and got.seconds > 0
    _same(s, got.session)
    assert store.where("sess-1") == 0  # promoted back to the top tier
    with pytest.raises(KeyError, match="no tier holds"):
        store.fetch("missing", engine, s.config)


def test_disk_tier_refuses_path_like_keys(tmp_path):
    with pytest.raises(ValueError, match="alphanumeric"):
        DiskTier(tmp_path).put("../escape", b"x")
