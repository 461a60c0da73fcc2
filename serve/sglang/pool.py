"""drop and reposition on SGLang's KV pool (`MHATokenToKVPool`) and request rows (`ReqToTokenPool.req_to_token`).

SGLang keeps, per layer, `k_buffer[layer]` / `v_buffer[layer]` of shape [slots, kv_heads, head_dim] (NHD layout),
and K is stored *after* RoPE at the token's position. A request's row `req_to_token[r, i]` is the slot of its token
i, and SGLang computes token i at position i. Hence:

- **reposition** (survivors to positions 0..r-1) is exact with no scheduler change: compact the row, and rotate each
  surviving K from its old position p to its new one q by K' = R(q - p) K (= R(q) R(p)^-1 K; V unchanged), with
  float64 angles (`kvsteward.kernels.rope`). In place when the slots are the request's own; as a **position
  version** (new slots, K rotated, V copied) when others may still read the originals — the tree always does this,
  so a cached state is never changed under another request.
- **drop** only removes entries from a row: the remaining tokens keep their slots (and so their stored positions;
  nothing is re-rotated). The *next* token must go to the history's next position, not to the row length: the
  request carries the difference (`req.kvsteward_position_offset`, tokens dropped since the last reposition) and
  the `ForwardBatch.init_new` hook in `kvsteward.serve.sglang.positions` adds it to the forward's positions.

The functions take the pool and allocator by duck type (`k_buffer`, `v_buffer`, `alloc`), so this module does not
import sglang.
"""

from __future__ import annotations

from typing import Any

import torch

from kvsteward.kernels.rope import ModelRope, RopeSpec, as_model_rope


def check_pool(pool: Any) -> None:
    """Refuse pools whose K cannot be rotated as plain [slots, heads, head_dim] tensors."""
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd":
        raise ValueError(f"kvsteward re-rotates K in the NHD pool layout only, got {layout!r}")
    if getattr(pool, "store_dtype", pool.dtype) != pool.dtype or getattr(pool, "is_quantized_kv_cache", False):
        raise ValueError("kvsteward cannot re-rotate a quantized KV cache (fp8/fp4): dequantize-rotate-requantize "
                         "is not exact")


def _rotate_into(pool: Any, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor,
                 spec: RopeSpec | ModelRope) -> None:
    """K[dst] = R(delta) K[src] with each layer's spec (a layer without RoPE copies K), V[dst] = V[src] for every
    layer (dst may equal src: in place)."""
    device = pool.k_buffer[0].device
    src, dst, delta = src.to(device), dst.to(device), delta.to(device)
    first = getattr(pool, "start_layer", 0) or 0  # a pipeline stage's pool holds layers first, first + 1, ...
    rope = as_model_rope(spec, first + len(pool.k_buffer))
    if len(rope) < first + len(pool.k_buffer):
        raise ValueError(f"the RoPE spec has {len(rope)} layers, the KV pool holds layers {first}.."
                         f"{first + len(pool.k_buffer) - 1}")
    rotations = rope.rotations(delta)  # one float64 evaluation per distinct spec, shared by its layers
    for i, (k_buf, v_buf) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        keys = k_buf[src].transpose(0, 1)  # [heads, n, head_dim]: rerotate wants the slot dim at -2
        k_buf[dst] = rope.rerotate_layer(first + i, keys, delta, k_buf.dtype, rotations).transpose(0, 1)
        if not torch.equal(src, dst):
            v_buf[dst] = v_buf[src]


def rerotate_in_place(pool: Any, slots: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor,
                      spec: RopeSpec | ModelRope) -> None:
    """Move the keys in `slots` from old to new positions in place (slots owned by one request only)."""
    check_pool(pool)
    _rotate_into(pool, slots.long(), slots.long(), (new_positions - old_positions).long(), spec)


def position_version(pool: Any, allocator: Any, slots: torch.Tensor, old_positions: torch.Tensor,
                     spec: RopeSpec | ModelRope) -> torch.Tensor | None:
    """New slots holding the keys of `slots` moved to positions 0..n-1 (V copied); the originals are untouched.
    None when the allocator has no room."""
    check_pool(pool)
    n = slots.numel()
    new = allocator.alloc(n)
    if new is None:
        return None
    new_positions = torch.arange(n, dtype=torch.int64)
    _rotate_into(pool, slots.long(), new.long(), new_positions - old_positions.long().cpu(), spec)
    return new.to(torch.int64)


def drop_from_row(req_to_token: torch.Tensor, row: int, length: int, drop: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Remove row entries `drop` (indices into the row) from request row `row` of length `length`, keeping order:
    returns (new length, removed slots). The caller frees the removed slots only if the request owns them."""
    entries = req_to_token[row, :length].clone()
    keep = torch.ones(length, dtype=torch.bool, device=entries.device)
    keep[drop.to(entries.device)] = False
    kept = entries[keep]
    req_to_token[row, : kept.numel()] = kept
    return kept.numel(), entries[~keep]


def reposition_row(pool: Any, req_to_token: torch.Tensor, row: int, length: int, old_positions: torch.Tensor,
                   spec: RopeSpec | ModelRope) -> None:
    """Reposition a request's own (unshared) row in place: its `length` entries, whose keys sit at `old_positions`,
    move to positions 0..length-1 — the row index, SGLang's rule for where the next token goes."""
    slots = req_to_token[row, :length].long()
    rerotate_in_place(pool, slots, old_positions.long(), torch.arange(length, dtype=torch.int64), spec)
