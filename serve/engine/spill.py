"""Spill store: the evicted KV of planned spans, kept in a storage tier so the blueprint can bring it back (PACE's
tiered rehydration).

When a session with a spill store evicts slots that lie in a planned span whose reader is still ahead, those slots
(keys as stored, values, fp32 reference keys when the table has them, and their metadata) are packed into one
safetensors blob and put into the store's tier — host memory, local disk or Valkey, the same tier classes idle
sessions use (`serve/engine/tiers.py`). Only planned tokens are kept: an unplanned evicted token can never be asked for,
so the store is bounded by the blueprint, not by the session length.

Blobs are shared by forks of a session (a fork copies the index, not the KV), so each blob carries a reference
count: an index entry holds one reference, and the blob is deleted when the last entry referring to it goes
(rehydrated, dropped, past its last reader, or its session garbage-collected).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvsteward.serve.engine.slots import SlotTable


class SpillError(RuntimeError):
    """A spilled blob is missing or does not hold the rows asked for (the session is left unchanged)."""


def pack_rows(t: SlotTable, rows: torch.Tensor) -> bytes:
    """Serialize slots `rows` of table `t` (bit-exact): K, V, reference K (if taken) and metadata."""
    return st_save({k: v.cpu() for k, v in t.export(rows).items()})


@dataclass
class SpillStats:
    puts: int = 0
    fetches: int = 0
    fetch_seconds: float = 0.0
    rehydrated_tokens: int = 0
    bytes_held: int = 0
    peak_bytes: int = 0


class SpillStore:
    """Blobs of spilled planned slots in one tier, with reference counts shared by every session that points at them.

    `on_fetch(tier_name, seconds, tokens)` is called after each rehydration fetch (server metrics)."""

    def __init__(self, tier, on_fetch: Callable[[str, float, int], None] | None = None):
        self.tier = tier
        self.on_fetch = on_fetch
        self.stats = SpillStats()
        self._refs: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._prefix = f"spill-{uuid.uuid4().hex[:12]}"
        self._ids = itertools.count()

    def put(self, blob: bytes, refs: int) -> str:
        """Store a blob referenced by `refs` index entries; returns its key."""
        if refs < 1:
            raise ValueError("a spilled blob needs at least one reference")
        key = f"{self._prefix}-{next(self._ids)}"
        self.tier.put(key, blob)
        with self._lock:
            self._refs[key] = refs
            self._sizes[key] = len(blob)
            self.stats.puts += 1
            self.stats.bytes_held += len(blob)
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_held)
        return key

    def retain(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._refs[key] += 1

    def release(self, keys) -> None:
        """Drop one reference per key (a key may repeat); a blob with no reference left is deleted from the tier."""
        gone = []
        with self._lock:
            for key in keys:
                n = self._refs.get(key)
                if n is None:
                    continue
                if n <= 1:
                    del self._refs[key]
                    self.stats.bytes_held -= self._sizes.pop(key)
                    gone.append(key)
                else:
                    self._refs[key] = n - 1
        for key in gone:
            self.tier.delete(key)

    def fetch(self, keys) -> dict[str, dict[str, torch.Tensor]]:
        """The rows of every blob in `keys` (distinct); raises SpillError if the tier lost one."""
        t0 = time.perf_counter()
        out = {}
        for key in keys:
            blob = self.tier.get(key)
            if blob is None:
                raise SpillError(f"spilled KV {key!r} is missing from the {self.tier.name} tier")
            out[key] = st_load(blob)
        seconds = time.perf_counter() - t0
        with self._lock:
            self.stats.fetches += 1
            self.stats.fetch_seconds += seconds
        return out

    def rows_of(self, index: dict[int, str], logical: list[int]) -> list[dict[str, torch.Tensor]]:
        """The spilled rows of the tokens `logical` (distinct), one set per blob, given the session's index (logical →
        blob key). Only the tokens indexed to a blob are taken from it: an older blob may also hold a token spilled
        again since. Raises SpillError (a lost or wrong blob) before the caller changes anything."""
        keys = sorted({index[i] for i in logical})
        blobs = self.fetch(keys)
        picked = []
        for key in keys:
            rows = blobs[key]
            mine = torch.tensor([i for i in logical if index[i] == key], dtype=torch.long)
            pick = torch.isin(rows["meta.logical"], mine)
            if int(pick.sum()) != mine.numel():
                raise SpillError(f"spilled KV {key!r} does not hold the tokens its index names")
            picked.append({name: (x[:, pick] if x.dim() == 3 else x[pick]) for name, x in rows.items()})
        return picked

    def note_rehydrated(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.stats.rehydrated_tokens += tokens
        if self.on_fetch is not None:
            self.on_fetch(self.tier.name, seconds, tokens)

    def held_keys(self) -> int:
        with self._lock:
            return len(self._refs)


def host_store() -> SpillStore:
    from kvsteward.serve.engine.tiers import HostTier

    return SpillStore(HostTier())
