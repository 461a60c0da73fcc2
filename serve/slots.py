"""The slot table: resident KV per layer in physical slots, plus per-slot metadata shared by every layer.

Slots are kept in logical order (appends go to the end, removals compact in place), so "renumber in logical order"
is simply positions 0..r-1 over the table. Keys are stored after RoPE at their physical position. The fp32 reference
keys (`ref_k`, `ref_pos`) exist from the first renumber on: every later rotation starts from them, never from the
previous rotated (rounded) key.
"""

from __future__ import annotations

import torch

META_FIELDS = ("logical", "token", "position", "step", "is_tool", "cumulative", "window", "ref_pos")


class SlotTable:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256):
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.n = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ref_k: list[torch.Tensor] | None = None
        self.meta: dict[str, torch.Tensor] = {}
        self._grow(capacity)

    # -- storage ------------------------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        shape = (self.n_kv_heads, capacity, self.head_dim)

        def grown(old: torch.Tensor | None, dtype) -> torch.Tensor:
            new = torch.zeros(shape, dtype=dtype, device=self.device)
            if old is not None:
                new[:, : self.n] = old[:, : self.n]
            return new

        self.k = [grown(self.k[i] if self.k else None, self.dtype) for i in range(self.n_layers)]
        self.v = [grown(self.v[i] if self.v else None, self.dtype) for i in range(self.n_layers)]
        if self.ref_k is not None:
            self.ref_k = [grown(r, torch.float32) for r in self.ref_k]
        meta_dtypes = {"is_tool": torch.bool, "cumulative": torch.float32, "window": torch.float32}
        for name in META_FIELDS:
            new = torch.zeros(capacity, dtype=meta_dtypes.get(name, torch.long), device=self.device)
            if name in self.meta:
                new[: self.n] = self.meta[name][: self.n]
            self.meta[name] = new
        self.capacity = capacity

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more slots (amortised doubling)."""
        need = self.n + extra
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage a chunk's K/V after the committed slots; return views of resident + staged K/V ([1, H, n+q, d])."""
        q = key.shape[2]
        self.k[layer][:, self.n : self.n + q] = key[0]
        self.v[layer][:, self.n : self.n + q] = value[0]
        return self.k[layer][None, :, : self.n + q], self.v[layer][None, :, : self.n + q]

    def commit(self, q: int, **meta: torch.Tensor) -> None:
        """Make the staged q slots resident, with their metadata."""
        s = slice(self.n, self.n + q)
        for name in META_FIELDS:
            self.meta[name][s] = meta.get(name, 0)
        if self.ref_k is not None:
            for layer in range(self.n_layers):
                self.ref_k[layer][:, s] = self.k[layer][:, s].float()
        self.n += q

    def keep(self, idx: torch.Tensor) -> None:
        """Compact to the slots `idx` (ascending), preserving their order."""
        m = idx.numel()
        for layer in range(self.n_layers):
            self.k[layer][:, :m] = self.k[layer][:, idx]
            self.v[layer][:, :m] = self.v[layer][:, idx]
            if self.ref_k is not None:
                self.ref_k[layer][:, :m] = self.ref_k[layer][:, idx]
        for name in META_FIELDS:
            self.meta[name][:m] = self.meta[name][idx]
        self.n = m

    def export(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Slots `idx` as named tensors (`k.L`, `v.L`, `ref_k.L` once reference keys exist, `meta.<field>`): what
        spilled KV and session snapshots serialize, and what `insert` takes back."""
        rows = {f"k.{i}": self.k[i][:, idx].contiguous() for i in range(self.n_layers)}
        rows |= {f"v.{i}": self.v[i][:, idx].contiguous() for i in range(self.n_layers)}
        if self.ref_k is not None:
            rows |= {f"ref_k.{i}": self.ref_k[i][:, idx].contiguous() for i in range(self.n_layers)}
        return rows | {f"meta.{name}": self.meta[name][idx].contiguous() for name in META_FIELDS}

    def insert(self, rows: dict[str, torch.Tensor]) -> None:
        """Add slots exported by `export` (K, V, optional fp32 reference K, metadata) and restore logical order.

        A table that has reference keys takes the rows' own reference keys, or — rows spilled before the table's first
        renumber — their keys as stored, at their stored positions (what `ensure_reference` would have taken)."""
        m = rows["meta.logical"].numel()
        if m == 0:
            return
        self.reserve(m)
        s = slice(self.n, self.n + m)
        for layer in range(self.n_layers):
            self.k[layer][:, s] = rows[f"k.{layer}"].to(self.device)
            self.v[layer][:, s] = rows[f"v.{layer}"].to(self.device)
        for name in META_FIELDS:
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
            self.ref_k = [torch.zeros(k.shape, dtype=torch.float32, device=self.device) for k in self.k]
            for layer in range(self.n_layers):
                self.ref_k[layer][:, : self.n] = self.k[layer][:, : self.n].float()
            self.meta["ref_pos"][: self.n] = self.meta["position"][: self.n]

    # -- views --------------------------------------------------------------------------------------------------
    def field(self, name: str) -> torch.Tensor:
        return self.meta[name][: self.n]

    def kv_bytes(self) -> int:
        """Bytes of resident KV (keys + values, all layers), excluding reserved capacity and reference keys."""
        per_slot = 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.k[0].element_size()
        return self.n * per_slot

    def allocated_bytes(self) -> int:
        """Bytes actually allocated (capacity, reference keys included): what the budget must bound."""
        total = sum(t.numel() * t.element_size() for t in self.k + self.v)
        if self.ref_k is not None:
            total += sum(t.numel() * t.element_size() for t in self.ref_k)
        return total + sum(t.numel() * t.element_size() for t in self.meta.values())

    def clone(self) -> SlotTable:
        other = SlotTable.__new__(SlotTable)
        other.__dict__.update(self.__dict__)
        other.k = [t.clone() for t in self.k]
        other.v = [t.clone() for t in self.v]
        other.ref_k = None if self.ref_k is None else [t.clone() for t in self.ref_k]
        other.meta = {k: t.clone() for k, t in self.meta.items()}
        return other
