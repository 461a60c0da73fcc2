"""Storage tiers for idle session states: host memory → local disk → Valkey (or Redis).

A state is serialized whole — resident K/V (compacted to the resident slots), the fp32 reference keys, the slot
metadata, the spilled planned KV of a tiered session, and the op history that defines it — as one safetensors blob
(tensors bit for bit; the JSON header carries the rest). Every tier stores the same blob under the session's key, so
moving a state down or back up never changes it; `TieredStore.fetch` reports which tier answered and how long the
restore took. The same tier classes hold the spilled planned KV of tiered sessions (`serve/engine/spill.py`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvsteward.serve.engine.session import Session, SessionConfig

_SCALARS = ("next_pos", "n_messages", "current_step", "peak_resident", "renumbers")


def snapshot(s: Session) -> bytes:
    """Serialize a session state (tensors bit-exact) into one blob."""
    tensors = s.table.export(torch.arange(s.table.n))
    if s.last_logits is not None:
        tensors["last_logits"] = s.last_logits.contiguous()
    spilled = _spilled_rows(s)
    tensors |= {f"spill.{name}": x for name, x in spilled.items()}
    header = {"history": s.history, "tokens": s.tokens, "status": list(s.status), "tool_steps": s.tool_steps,
              **{k: getattr(s, k) for k in _SCALARS}}
    return st_save(tensors, metadata={"kvsteward": json.dumps(header)})


def _spilled_rows(s: Session) -> dict[str, torch.Tensor]:
    """The session's spilled planned KV, gathered from its spill store into one set of rows (the snapshot then does
    not depend on the store, which may be another process's memory)."""
    if not s.spilled:
        return {}
    parts = s.config.spill.rows_of(s.spilled, list(s.spilled))
    return {name: torch.cat([p[name] for p in parts], dim=1 if parts[0][name].dim() == 3 else 0).contiguous()
            for name in parts[0]}


def load_snapshot(engine, config: SessionConfig, blob: bytes) -> Session:
    """Rebuild the session a `snapshot` blob holds, on `engine` with `config`."""

    tensors = st_load(blob)
    header = json.loads(_metadata(blob)["kvsteward"])
    s = Session(engine, config)
    if "ref_k.0" in tensors:
        s.table.ensure_reference()  # (empty table: allocates the reference keys the rows bring)
    s.table.insert(tensors)  # the rows are in logical order already
    s.history, s.tokens, s.status = header["history"], header["tokens"], bytearray(header["status"])
    s.tool_steps = header["tool_steps"]
    for k in _SCALARS:
        setattr(s, k, header[k])
    s.last_logits = tensors.get("last_logits")
    spill = {name[len("spill."):]: x for name, x in tensors.items() if name.startswith("spill.")}
    if spill and config.spill is not None:  # back into this engine's spill store, one blob
        key = config.spill.put(st_save(spill), refs=spill["meta.logical"].numel())
        s.spilled.update({int(i): key for i in spill["meta.logical"].tolist()})
    return s


def _metadata(blob: bytes) -> dict:
    # safetensors layout: 8-byte little-endian header length, then the JSON header (with __metadata__)
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size])["__metadata__"]


class HostTier:
    name = "host"

    def __init__(self):
        self._blobs: dict[str, bytes] = {}

    def put(self, key: str, blob: bytes) -> None:
        self._blobs[key] = blob

    def get(self, key: str) -> bytes | None:
        return self._blobs.get(key)

    def delete(self, key: str) -> None:
        self._blobs.pop(key, None)


class DiskTier:
    name = "disk"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"tier key {key!r} must be alphanumeric (with - or _)")
        return self.root / f"{key}.kvstate"

    def put(self, key: str, blob: bytes) -> None:
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)  # atomic: a crash leaves the old state or the new one, never half of one

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        return path.read_bytes() if path.exists() else None

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class ValkeyTier:
    """A Valkey (or Redis) server reached with the `valkey` client."""

    name = "valkey"

    def __init__(self, url: str = "valkey://127.0.0.1:6379/0", prefix: str = "kvsteward:state:"):
        import valkey

        self.client = valkey.Valkey.from_url(url.replace("valkey://", "redis://", 1))
        self.prefix = prefix

    def put(self, key: str, blob: bytes) -> None:
        self.client.set(self.prefix + key, blob)

    def get(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)

    def delete(self, key: str) -> None:
        self.client.delete(self.prefix + key)


@dataclass
class Fetched:
    session: Session
    tier: str
    seconds: float


class TieredStore:
    """Tiers ordered fastest first; `demote` moves a state one tier down, `fetch` restores it from the highest tier
    that holds it (and promotes it back to the top)."""

    def __init__(self, tiers: list):
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = tiers

    def put(self, key: str, s: Session, tier: int = 0) -> None:
        self.tiers[tier].put(key, snapshot(s))

    def where(self, key: str) -> int | None:
        return next((i for i, t in enumerate(self.tiers) if t.get(key) is not None), None)

    def demote(self, key: str) -> int:
        i = self.where(key)
        if i is None:
            raise KeyError(f"no tier holds state {key!r}")
        if i + 1 >= len(self.tiers):
            return i
        blob = self.tiers[i].get(key)
        self.tiers[i + 1].put(key, blob)  # write below before deleting above: never zero copies
        self.tiers[i].delete(key)
        return i + 1

    def fetch(self, key: str, engine, config: SessionConfig, promote: bool = True) -> Fetched:
        t0 = time.perf_counter()
        for i, tier in enumerate(self.tiers):
            blob = tier.get(key)
            if blob is not None:
                s = load_snapshot(engine, config, blob)
                seconds = time.perf_counter() - t0
                if promote and i > 0:
                    self.tiers[0].put(key, blob)
                    tier.delete(key)
                return Fetched(s, tier.name, seconds)
        raise KeyError(f"no tier holds state {key!r}")


class SessionTiers:
    """The server's idle-session tiers: an unloaded session's snapshot enters the top tier; each tier has a byte
    budget beyond which its least recently stored states move one tier down (write below, then delete above); beyond
    the last tier's budget a state is deleted (the session then rebuilds from its persisted history). `take` fetches
    a state from the highest tier holding it and deletes it everywhere: once loaded, the live session is the state.
    """

    def __init__(self, tiers: list, budgets: list[int | None], metrics=None):
        if len(tiers) != len(budgets):
            raise ValueError("one budget per tier")
        self.store = TieredStore(tiers)
        self.budgets = budgets
        self.metrics = metrics
        self._where: dict[str, tuple[int, int]] = {}  # key -> (tier index, bytes), insertion order = LRU order
        self._lock = threading.Lock()

    @property
    def tiers(self) -> list:
        return self.store.tiers

    def adopt(self, key: str, tier: int, nbytes: int) -> None:
        """Register a state already in a tier (a disk blob found at start-up)."""
        with self._lock:
            self._where[key] = (tier, nbytes)
            self._enforce()

    def put(self, key: str, s: Session) -> int:
        blob = snapshot(s)
        with self._lock:
            self._discard(key)
            self.tiers[0].put(key, blob)
            self._where[key] = (0, len(blob))
            self._count(0)
            self._enforce()
            return len(blob)

    def take(self, key: str, engine, config: SessionConfig) -> Fetched | None:
        with self._lock:
            try:
                got = self.store.fetch(key, engine, config, promote=False)
            except KeyError:
                got = None
            self._discard(key)
            self._publish()
        return got

    def discard(self, key: str) -> None:
        with self._lock:
            self._discard(key)
            self._publish()

    def where(self, key: str) -> str | None:
        i = self.store.where(key)
        return None if i is None else self.tiers[i].name

    def _discard(self, key: str) -> None:
        self._where.pop(key, None)
        for tier in self.tiers:
            tier.delete(key)

    def _count(self, i: int) -> None:
        if self.metrics is not None:
            self.metrics.tier_stores.labels(self.tiers[i].name).inc()

    def _enforce(self) -> None:
        for i, budget in enumerate(self.budgets):
            if budget is None:
                continue
            held = [(k, n) for k, (t, n) in self._where.items() if t == i]
            total = sum(n for _, n in held)
            for key, nbytes in held:  # oldest first
                if total <= budget:
                    break
                total -= nbytes
                if i + 1 < len(self.tiers):
                    self.store.demote(key)
                    self._where.pop(key)
                    self._where[key] = (i + 1, nbytes)  # re-inserted: the newest of the tier below
                    self._count(i + 1)
                else:
                    self._discard(key)
        self._publish()

    def _publish(self) -> None:
        if self.metrics is None:
            return
        for i, tier in enumerate(self.tiers):
            self.metrics.tier_bytes.labels(tier.name).set(sum(n for t, n in self._where.values() if t == i))
