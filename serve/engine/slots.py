"""The slot table: resident KV per layer in physical slots, plus per-slot metadata shared by every layer.

Slots are kept in logical order (appends go to the end, removals compact in place), so "renumber in logical order"
is simply positions 0..r-1 over the table. Keys are stored after RoPE at their physical position. The fp32 reference
keys (`ref_k`, `ref_pos`) exist from the first renumber on: every later rotation starts from them, never from the
previous rotated (rounded) key.

A *shared fork* (`share`) copies no K/V: it reads the parent's resident rows in place (a `SharedPrefix`) and keeps
only what it appends in its own storage (the tail). Its slots are the prefix rows still `alive` (in their order),
then its tail; its own evictions and drops only clear `alive`. The parent never writes a row a live shared fork reads:
while one exists, the parent's compaction and re-rotation write into fresh buffers (copy-on-write; a compaction costs
the same either way), and its appends land past the shared rows. A fork that must rewrite its prefix rows (a renumber,
a rehydration) first takes a dense copy of its slots (`own_rows`).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

META_FIELDS = ("logical", "token", "position", "step", "is_tool", "cumulative", "window", "ref_pos")
# per-head selection (`SessionConfig.per_head`): per slot, one column per (layer, KV head), index layer * Hkv + head
HEAD_FIELDS = ("head_alive", "head_score")


@dataclass(eq=False)
class SharedPrefix:
    """Rows [0, n0) of another table's storage, read in place by a shared fork and written by nobody."""

    k: list[torch.Tensor]  # per layer [Hkv, n0, d] views of the parent's storage
    v: list[torch.Tensor]
    ref_k: list[torch.Tensor] | None  # the parent's fp32 reference keys, when it had them
    alive: torch.Tensor  # [n0] bool: rows still resident in the fork
    sharers: weakref.WeakSet  # the owner's set of live prefixes over these rows (a fork of the fork joins it)

    def rows(self) -> torch.Tensor:
        return torch.nonzero(self.alive).view(-1)

    def branch(self) -> SharedPrefix:
        """The same rows for another fork, with its own `alive` flags."""
        return dataclasses.replace(self, alive=self.alive.clone())


class SlotTable:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256, per_head: bool = False):
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        # per-head selection: each (layer, KV head) sees only the slots it kept (`head_alive`); a slot stays resident
        # while any head keeps it. The rows stay dense (masked, not ragged: on CPU a ragged cache saves nothing)
        self.meta_fields = META_FIELDS + (HEAD_FIELDS if per_head else ())
        self.dtype, self.device = dtype, device
        self.n = 0
        self.capacity = 0  # slots the metadata holds
        self.base = 0  # slots that live in the shared prefix (0 unless this is a shared fork)
        self.prefix: SharedPrefix | None = None
        self.sharers: weakref.WeakSet = weakref.WeakSet()  # live shared forks reading rows of `self.k` / `self.v`
        self.k: list[torch.Tensor] = []  # own storage: slot i >= base lives in row i - base
        self.v: list[torch.Tensor] = []
        self.ref_k: list[torch.Tensor] | None = None
        self.meta: dict[str, torch.Tensor] = {}
        self._grow(capacity)

    # -- storage ------------------------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        meta_dtypes = {"is_tool": torch.bool, "cumulative": torch.float32, "window": torch.float32,
                       "head_alive": torch.bool, "head_score": torch.float32}
        for name in self.meta_fields:
            shape = (capacity, self.n_layers * self.n_kv_heads) if name in HEAD_FIELDS else (capacity,)
            new = torch.zeros(shape, dtype=meta_dtypes.get(name, torch.long), device=self.device)
            if name in self.meta:
                new[: self.n] = self.meta[name][: self.n]
            self.meta[name] = new
        self._grow_rows(capacity - self.base)
        self.capacity = capacity

    def _grow_rows(self, rows: int) -> None:
        """Own storage of at least `rows` rows (the used rows are copied into fresh buffers)."""
        if self.k and rows <= self.k[0].shape[1]:
            return
        used = self.n - self.base

        def grown(old: torch.Tensor | None, dtype) -> torch.Tensor:
            new = torch.zeros((self.n_kv_heads, rows, self.head_dim), dtype=dtype, device=self.device)
            if old is not None:
                new[:, :used] = old[:, :used]
            return new

        self.k = [grown(self.k[i] if self.k else None, self.dtype) for i in range(self.n_layers)]
        self.v = [grown(self.v[i] if self.v else None, self.dtype) for i in range(self.n_layers)]
        if self.ref_k is not None:
            self.ref_k = [grown(r, torch.float32) for r in self.ref_k]
        self.sharers = weakref.WeakSet()  # shared forks keep reading the old buffers

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more slots (amortised doubling)."""
        need = self.n + extra
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))
        rows = self.n - self.base + extra
        if rows > self.k[0].shape[1]:
            self._grow_rows(max(rows, 2 * self.k[0].shape[1]))

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage a chunk's K/V after the committed slots; return views of own resident + staged K/V ([1, H, m+q, d];
        a shared fork's prefix rows reach attention through `ForwardContext.prefix`)."""
        q, m = key.shape[2], self.n - self.base
        self.k[layer][:, m : m + q] = key[0]
        self.v[layer][:, m : m + q] = value[0]
        return self.k[layer][None, :, : m + q], self.v[layer][None, :, : m + q]

    def commit(self, q: int, **meta: torch.Tensor) -> None:
        """Make the staged q slots resident, with their metadata."""
        s = slice(self.n, self.n + q)
        for name in self.meta_fields:
            self.meta[name][s] = meta.get(name, name == "head_alive")  # a new slot is seen by every head
        if self.ref_k is not None:
            rows = slice(self.n - self.base, self.n - self.base + q)
            for layer in range(self.n_layers):
                self.ref_k[layer][:, rows] = self.k[layer][:, rows].float()
        self.n += q

    def keep(self, idx: torch.Tensor) -> None:
        """Compact to the slots `idx`, in that order (ascending keeps logical order). A shared fork only marks its
        prefix rows dead (idx must then be ascending); a table that shared forks read compacts into fresh buffers."""
        m = idx.numel()
        if self.prefix is not None:
            if m > 1 and bool((idx[1:] <= idx[:-1]).any()):
                raise ValueError("a shared fork keeps slots in order only (take own_rows() first to permute)")
            in_prefix = idx < self.base
            rows = self.prefix.rows()[idx[in_prefix]]
            self.prefix.alive.zero_()
            self.prefix.alive[rows] = True
            self._keep_rows(idx[~in_prefix] - self.base)
            self.base = rows.numel()
        else:
            self._keep_rows(idx)
        for name in self.meta_fields:
            self.meta[name][:m] = self.meta[name][idx]
        self.n = m

    def _keep_rows(self, rows: torch.Tensor) -> None:
        m = rows.numel()
        if len(self.sharers):  # copy-on-write: the shared forks keep the rows they read
            def compacted(old: torch.Tensor) -> torch.Tensor:
                new = torch.empty_like(old)  # rows past m are never read before they are written
                for h in range(old.shape[0]):  # gather straight into the new rows (no temporary)
                    torch.index_select(old[h], 0, rows, out=new[h, :m])
                return new

            self.k = [compacted(t) for t in self.k]
            self.v = [compacted(t) for t in self.v]
            if self.ref_k is not None:
                self.ref_k = [compacted(t) for t in self.ref_k]
            self.sharers = weakref.WeakSet()
            return
        for layer in range(self.n_layers):
            self.k[layer][:, :m] = self.k[layer][:, rows]
            self.v[layer][:, :m] = self.v[layer][:, rows]
            if self.ref_k is not None:
                self.ref_k[layer][:, :m] = self.ref_k[layer][:, rows]

    def own_rows(self) -> None:
        """Make every resident slot a row of this table's own storage that nobody else reads, before rewriting rows
        in place: a shared fork takes a dense copy of its slots; a table that shared forks read moves to a copy."""
        if self.prefix is not None:
            p, used = self.prefix, self.n - self.base
            rows = p.rows()

            def dense(prefix: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
                new = torch.zeros((self.n_kv_heads, self.capacity, self.head_dim), dtype=own.dtype,
                                  device=self.device)
                new[:, : self.base] = prefix[:, rows]
                new[:, self.base : self.n] = own[:, :used]
                return new

            self.k = [dense(a, b) for a, b in zip(p.k, self.k, strict=True)]
            self.v = [dense(a, b) for a, b in zip(p.v, self.v, strict=True)]
            if self.ref_k is not None:
                self.ref_k = [dense(a, b) for a, b in zip(p.ref_k, self.ref_k, strict=True)]
            self.prefix, self.base = None, 0
        elif len(self.sharers):
            self.k = [t.clone() for t in self.k]
            self.v = [t.clone() for t in self.v]
            if self.ref_k is not None:
                self.ref_k = [t.clone() for t in self.ref_k]
            self.sharers = weakref.WeakSet()

    def share(self) -> SlotTable:
        """A shared fork: the same slots, reading this table's K/V rows in place (no copy); only the metadata (a few
        integers per slot) is copied. A fork of a shared fork reads the same prefix rows and copies the small tail."""
        other = SlotTable.__new__(SlotTable)
        other.__dict__.update(self.__dict__)
        other.meta = {k: t.clone() for k, t in self.meta.items()}
        other.sharers = weakref.WeakSet()
        if self.prefix is None:
            n = self.n
            other.prefix = SharedPrefix(k=[t[:, :n] for t in self.k], v=[t[:, :n] for t in self.v],
                                        ref_k=None if self.ref_k is None else [t[:, :n] for t in self.ref_k],
                                        alive=torch.ones(n, dtype=torch.bool, device=self.device),
                                        sharers=self.sharers)
            other.base = n
            other.k, other.v = [], []
            other._grow_rows(64)  # an empty tail of its own (reference keys too, when the parent has them)
        else:
            other.prefix = self.prefix.branch()
            other.k = [t.clone() for t in self.k]
            other.v = [t.clone() for t in self.v]
            other.ref_k = None if self.ref_k is None else [t.clone() for t in self.ref_k]
        other.prefix.sharers.add(other.prefix)
        return other

    def _gather(self, own: list[torch.Tensor], prefix: list[torch.Tensor] | None, idx: torch.Tensor,
                layer: int) -> torch.Tensor:
        if self.prefix is None:
            return own[layer][:, idx].contiguous()
        in_prefix = idx < self.base
        out = torch.empty((self.n_kv_heads, idx.numel(), self.head_dim), dtype=own[layer].dtype, device=self.device)
        out[:, in_prefix] = prefix[layer][:, self.prefix.rows()[idx[in_prefix]]]
        out[:, ~in_prefix] = own[layer][:, idx[~in_prefix] - self.base]
        return out

    def export(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Slots `idx` as named tensors (`k.L`, `v.L`, `ref_k.L` once reference keys exist, `meta.<field>`): what
        spilled KV and session snapshots serialize, and what `insert` takes back."""
        p = self.prefix
        rows = {f"k.{i}": self._gather(self.k, p and p.k, idx, i) for i in range(self.n_layers)}
        rows |= {f"v.{i}": self._gather(self.v, p and p.v, idx, i) for i in range(self.n_layers)}
        if self.ref_k is not None:
            rows |= {f"ref_k.{i}": self._gather(self.ref_k, p and p.ref_k, idx, i) for i in range(self.n_layers)}
        return rows | {f"meta.{name}": self.meta[name][idx].contiguous() for name in self.meta_fields}

    def insert(self, rows: dict[str, torch.Tensor]) -> None:
        """Add slots exported by `export` (K, V, optional fp32 reference K, metadata) and restore logical order.

        A table that has reference keys takes the rows' own reference keys, or — rows spilled before the table's first
        renumber — their keys as stored, at their stored positions (what `ensure_reference` would have taken)."""
        m = rows["meta.logical"].numel()
        if m == 0:
            return
        self.own_rows()
        self.reserve(m)
        s = slice(self.n, self.n + m)
        for layer in range(self.n_layers):
            self.k[layer][:, s] = rows[f"k.{layer}"].to(self.device)
            self.v[layer][:, s] = rows[f"v.{layer}"].to(self.device)
        for name in self.meta_fields:
            self.meta[name][s] = rows[f"meta.{name}"].to(self.device)
        if self.ref_k is not None:
            has_ref = "ref_k.0" in rows
            for layer in range(self.n_layers):
                self.ref_k[layer][:, s] = (rows[f"ref_k.{layer}"] if has_ref else rows[f"k.{layer}"].float()).to(
                    self.device)
            if not has_ref:
                self.meta["ref_pos"][s] = self.meta["position"][s]
        self.n += m
        self.keep(torch.argsort(self.field("logical")))

    def ensure_reference(self) -> None:
        """Take the fp32 reference keys at the first renumber (keys as stored, at their current positions)."""
        if self.ref_k is None:
            self.own_rows()
            self.ref_k = [torch.zeros(k.shape, dtype=torch.float32, device=self.device) for k in self.k]
            for layer in range(self.n_layers):
                self.ref_k[layer][:, : self.n] = self.k[layer][:, : self.n].float()
            self.meta["ref_pos"][: self.n] = self.meta["position"][: self.n]

    # -- views --------------------------------------------------------------------------------------------------
    def field(self, name: str) -> torch.Tensor:
        return self.meta[name][: self.n]

    @property
    def per_head(self) -> bool:
        return "head_alive" in self.meta

    def head_visible(self) -> torch.Tensor | None:
        """[layers, Hkv, n] bool: which resident slots each (layer, KV head) sees; None without per-head selection."""
        if not self.per_head:
            return None
        return self.meta["head_alive"][: self.n].T.reshape(self.n_layers, self.n_kv_heads, self.n)

    def kv_bytes(self) -> int:
        """Bytes of resident KV (keys + values, all layers), excluding reserved capacity and reference keys."""
        per_slot = 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.k[0].element_size()
        return self.n * per_slot

    def ref_bytes(self) -> int:
        """Bytes of the resident slots' fp32 reference keys (0 before the first renumber)."""
        if self.ref_k is None:
            return 0
        return self.n * self.n_layers * self.n_kv_heads * self.head_dim * 4

    def allocated_bytes(self) -> int:
        """Bytes this table allocated (capacity, reference keys included): what the budget must bound. A shared
        fork's prefix rows are the parent's allocation and are not counted."""
        total = sum(t.numel() * t.element_size() for t in self.k + self.v)
        if self.ref_k is not None:
            total += sum(t.numel() * t.element_size() for t in self.ref_k)
        return total + sum(t.numel() * t.element_size() for t in self.meta.values())

    def clone(self) -> SlotTable:
        """An independent dense copy (no shared rows either way)."""
        other = SlotTable.__new__(SlotTable)
        other.__dict__.update(self.__dict__)
        other.k = [t.clone() for t in self.k]
        other.v = [t.clone() for t in self.v]
        other.ref_k = None if self.ref_k is None else [t.clone() for t in self.ref_k]
        other.meta = {k: t.clone() for k, t in self.meta.items()}
        other.sharers = weakref.WeakSet()
        if self.prefix is not None:
            other.prefix = self.prefix.branch()
            other.own_rows()
        return other
