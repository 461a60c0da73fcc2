"""The engine's attention function, registered with transformers' `AttentionInterface` as "steward".

It sees the resident keys (old slots first, then the chunk's new slots), applies "old slots all visible + causal
among new ones", and — only when the policy asks — accumulates the attention each slot receives:

- `cumulative` (H2O, foresight): column sums of the softmax over every query of the chunk, computed in query tiles
  so the full n×n matrix of a long session never exists at once;
- `window` (SnapKV vote, TOVA): SDPA for the output, and the probabilities of the last `window` queries only.

Scores are averaged over query heads and summed over layers, so every layer/head votes for one shared slot score
(slots are evicted for all layers at once; a ragged per-head cache would save nothing on CPU). With per-head selection
(`SessionConfig.per_head`) each (layer, KV head) keeps its own slots: `_per_head` masks, per KV head, the old slots
that head evicted, and returns one score row per (layer, KV head).

A shared fork (`SlotTable.share`) has two key segments: the parent's rows it reads in place (`ForwardContext.prefix`,
dead rows masked) and its own rows. `_two_segment` takes one softmax over both score blocks and sums the two value
products: the same attention as over the concatenated keys, without concatenating (copying) them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvsteward.serve.engine.slots import SharedPrefix

NAME = "steward"
_QUERY_TILE_ELEMS = 1 << 22  # floats of one probability tile (≈16 MiB fp32): bounds score memory on long sessions


@dataclass
class ForwardContext:
    """What one engine forward tells the attention function, and what it collects back."""

    n_old: int  # resident slots before this chunk (all visible to every new query)
    score_mode: str = "none"  # "none" | "cumulative" | "window"
    window: int = 1
    n_layers: int = 1
    scores: torch.Tensor | None = None  # [n_old + q] float32, summed over layers
    prefix: SharedPrefix | None = None  # a shared fork's in-place parent rows (keys/values first in slot order)
    # per-head selection: [layers, Hkv, n_old] which old slots each (layer, KV head) sees; the per-head scores come
    # back in `head_scores` ([layers, Hkv, n_old + q], each KV head's query heads averaged)
    head_visible: torch.Tensor | None = None
    head_scores: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def add(self, col_scores: torch.Tensor) -> None:
        self.scores = col_scores if self.scores is None else self.scores + col_scores


def _mask(q: int, n_old: int, device: torch.device) -> torch.Tensor:
    """Boolean [q, n_old + q]: every old slot visible, causal among the chunk's new slots."""
    old = torch.ones(q, n_old, dtype=torch.bool, device=device)
    new = torch.ones(q, q, dtype=torch.bool, device=device).tril_()
    return torch.cat([old, new], dim=1)


def _probs(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax probabilities [Hkv, g, q, n] in fp32, GQA by grouping query heads (no repeat_kv copy)."""
    hkv, n, d = key.shape[1], key.shape[2], key.shape[3]
    hq, q = query.shape[1], query.shape[2]
    g = hq // hkv
    qg = query[0].reshape(hkv, g * q, d).float()
    s = torch.matmul(qg, key[0].float().transpose(1, 2)).mul_(scaling).view(hkv, g, q, n)
    s.masked_fill_(~mask, float("-inf"))
    return torch.softmax(s, dim=-1)


def _cumulative(query, key, value, mask, scaling, ctx: ForwardContext) -> torch.Tensor:
    """Exact attention in query tiles, accumulating column sums of the probabilities."""
    hkv, n, d = key.shape[1], key.shape[2], key.shape[3]
    hq, q = query.shape[1], query.shape[2]
    g = hq // hkv
    tile = max(1, _QUERY_TILE_ELEMS // max(1, hq * n))
    out = torch.empty(hkv, g, q, d, dtype=torch.float32, device=query.device)
    col = torch.zeros(n, dtype=torch.float32, device=query.device)
    v = value[0].float()
    for start in range(0, q, tile):
        stop = min(q, start + tile)
        p = _probs(query[:, :, start:stop], key, mask[start:stop], scaling)
        col += p.sum(dim=(0, 1, 2))
        out[:, :, start:stop] = torch.matmul(p.view(hkv, g * (stop - start), n), v).view(hkv, g, stop - start, d)
    ctx.add(col / (hq * ctx.n_layers))
    return out.view(1, hq, q, d).to(query.dtype)


def _two_segment(query, key, value, mask, scaling, ctx: ForwardContext, layer: int) -> torch.Tensor:
    """Attention over [alive prefix rows ; own rows] (own rows: old all visible, new causal), in query tiles; column
    scores (every mode) in slot order: alive prefix rows, then own rows."""
    p = ctx.prefix
    pk, pv, alive = p.k[layer].float(), p.v[layer].float(), p.alive
    hkv, n, d = key.shape[1], key.shape[2], key.shape[3]
    hq, q = query.shape[1], query.shape[2]
    g, n0 = hq // hkv, pk.shape[1]
    k, v = key[0].float(), value[0].float()
    tile = max(1, _QUERY_TILE_ELEMS // max(1, hq * (n0 + n)))
    first_scored = {"cumulative": 0, "window": q - min(ctx.window, q)}.get(ctx.score_mode, q)
    out = torch.empty(hkv, g, q, d, dtype=torch.float32, device=query.device)
    col = torch.zeros(n0 + n, dtype=torch.float32, device=query.device)
    for start in range(0, q, tile):
        stop = min(q, start + tile)
        t = stop - start
        qg = query[0, :, start:stop].reshape(hkv, g * t, d).float()
        s_prefix = torch.matmul(qg, pk.transpose(1, 2)).mul_(scaling).masked_fill_(~alive, float("-inf"))
        s_own = torch.matmul(qg, k.transpose(1, 2)).mul_(scaling).view(hkv, g, t, n)
        s_own = s_own.masked_fill_(~mask[start:stop], float("-inf")).view(hkv, g * t, n)
        probs = torch.softmax(torch.cat([s_prefix, s_own], dim=-1), dim=-1)
        o = torch.matmul(probs[..., :n0], pv) + torch.matmul(probs[..., n0:], v)
        out[:, :, start:stop] = o.view(hkv, g, t, d)
        if stop > first_scored:
            lo = max(0, first_scored - start)
            col += probs.view(hkv, g, t, n0 + n)[:, :, lo:].sum(dim=(0, 1, 2))
    if ctx.score_mode in ("cumulative", "window"):
        ctx.add(torch.cat([col[:n0][alive], col[n0:]]) / (hq * ctx.n_layers))
    return out.view(1, hq, q, d).to(query.dtype)


def _per_head(query, key, value, mask, scaling, ctx: ForwardContext, layer: int) -> torch.Tensor:
    """Attention where each KV head sees only the old slots it kept (`ctx.head_visible[layer]`; new slots causal),
    in query tiles; the per-head column scores of the policy's mode go to `ctx.head_scores[layer]`."""
    hkv, n, d = key.shape[1], key.shape[2], key.shape[3]
    hq, q = query.shape[1], query.shape[2]
    g = hq // hkv
    visible = torch.cat([ctx.head_visible[layer].to(query.device),
                         torch.ones(hkv, q, dtype=torch.bool, device=query.device)], dim=1)  # [Hkv, n]
    tile = max(1, _QUERY_TILE_ELEMS // max(1, hq * n))
    first_scored = {"cumulative": 0, "window": q - min(ctx.window, q)}.get(ctx.score_mode, q)
    out = torch.empty(hkv, g, q, d, dtype=torch.float32, device=query.device)
    col = torch.zeros(hkv, n, dtype=torch.float32, device=query.device)
    v = value[0].float()
    for start in range(0, q, tile):
        stop = min(q, start + tile)
        p = _probs(query[:, :, start:stop], key, mask[start:stop][None, None] & visible[:, None, None, :], scaling)
        out[:, :, start:stop] = torch.matmul(p.view(hkv, g * (stop - start), n), v).view(hkv, g, stop - start, d)
        if stop > first_scored:
            col += p[:, :, max(0, first_scored - start):].sum(dim=(1, 2))
    if ctx.head_scores is None:
        ctx.head_scores = torch.zeros(ctx.n_layers, hkv, n, dtype=torch.float32, device=query.device)
    ctx.head_scores[layer] = col / g
    return out.view(1, hq, q, d).to(query.dtype)


def steward_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, steward=None, **kwargs):
    """AttentionInterface signature: query [1,Hq,q,d], key/value [1,Hkv,n,d] → ([1,q,Hq,d], None)."""
    ctx: ForwardContext = steward
    if ctx is None:
        raise RuntimeError(f"steward attention called without a ForwardContext in {type(module).__name__}: either "
                           "model() was called directly (use the engine), or this model family's layers do not pass "
                           "their keyword arguments on to attention, so the engine cannot run it")
    q, n = query.shape[2], key.shape[2]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mask = _mask(q, n - q, query.device)
    if ctx.head_visible is not None:
        if ctx.prefix is not None:
            raise RuntimeError("per-head selection does not run on a shared fork (take a copy: fork(shared=False))")
        out = _per_head(query, key, value, mask, scaling, ctx, module.layer_idx)
    elif ctx.prefix is not None:
        out = _two_segment(query, key, value, mask, scaling, ctx, module.layer_idx)
    elif ctx.score_mode == "cumulative":
        out = _cumulative(query, key, value, mask, scaling, ctx)
    else:
        sdpa_mask = None if q == 1 else mask  # one query sees every resident slot: no mask needed
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=sdpa_mask, scale=scaling, enable_gqa=True)
        if ctx.score_mode == "window":
            w = min(ctx.window, q)
            p = _probs(query[:, :, q - w:], key, mask[q - w:], scaling)
            ctx.add(p.sum(dim=(0, 1, 2)) / (query.shape[1] * ctx.n_layers))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, steward_attention)


@contextmanager
def steward_attention_enabled(model, name: str = NAME):
    """Route the model's attention through a registered engine attention function for the duration of a forward."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
