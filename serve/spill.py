"""Spill store: the evicted KV of planned spans, kept in a storage tier so the blueprint can bring it back (PACE's
tiered rehydration).

When a session with a spill store evicts slots that lie in a planned span whose reader is still ahead, those slots
(keys as stored, values, fp32 reference keys when the table has them, and their metadata) are packed into one
safetensors blob and put into the store's tier — host memory, local disk or Valkey, the same tier classes idle
sessions use (`serve/tiers.py`). Only planned tokens are kept: an unplanned evicted token can never be asked for,
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

from kvsteward.serve.slots import META_FIELDS, SlotTable


class SpillError(RuntimeError):
    """A spilled blob is missing or does not hold the rows asked for (the session is left unchanged)."""


def pack_rows(t: SlotTable, rows: torch.Tensor) -> bytes:
    """Serialize slots `rows` of table `t` (bit-exact): K, V, reference K (if taken) and metadata."""
    tensors = {f"k.{i}": t.k[i][:, rows].contiguous() for i in range(t.n_layers)}
    tensors |= {f"v.{i}": t.v[i][:, rows].contiguous() for i in range(t.n_layers)}
    if t.ref_k is not None:
        tensors |= {f"ref_k.{i}": t.ref_k[i][:, rows].contiguous() for i in range(t.n_layers)}
    tensors |= {f"meta.{name}": t.meta[name][rows].contiguous() for name in META_FIELDS}
    return st_save({k: v.cpu() for k, v in tensors.items()})


def unpack_rows(blob: bytes) -> dict[str, torch.Tensor]:
    return st_load(blob)


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

    @property
    def tier_name(self) -> str:
        return self.tier.name

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
            out[key] = unpack_rows(blob)
        seconds = time.perf_counter() - t0
        with self._lock:
            self.stats.fetches += 1
            self.stats.fetch_seconds += seconds
        return out

    def note_rehydrated(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.stats.rehydrated_tokens += tokens
        if self.on_fetch is not None:
            self.on_fetch(self.tier.name, seconds, tokens)

    def held_keys(self) -> int:
        with self._lock:
            return len(self._refs)


def host_store() -> SpillStore:
    from kvsteward.serve.tiers import HostTier

    return SpillStore(HostTier())
