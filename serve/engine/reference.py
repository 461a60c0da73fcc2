"""Reference path for every cache operation, independent of the engine's code.

It runs the model through transformers' own attention (sdpa) and its own `DynamicCache`, and implements
drop / reposition directly on that cache: drop removes key/value columns; reposition rotates keys with a float64
complex-number rotation written here (not the engine's kernel). Appends pass explicit position ids. The engine must
match it op for op; tests and `steward engine check` compare the two.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

MASKED = "kvsteward_reference_masked"


def _masked_sdpa(module, query, key, value, attention_mask, reference_masks=None, **kwargs):
    """transformers' own sdpa attention with this layer's mask from `reference_masks` (per-head selection: each
    query head's additive mask over the layer's columns), in place of the model's causal mask."""
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, reference_masks[module.layer_idx], is_causal=False,
                                  **kwargs)


AttentionInterface.register(MASKED, _masked_sdpa)


def rotate_complex(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, layout: str) -> torch.Tensor:
    """R(delta) K in float64 via complex multiplication; keys [..., n, d], delta [n]; returns float64. Only the first
    2 * len(inv_freq) dims rotate (partial rotary); the rest pass through."""
    k = keys.double()
    d = 2 * inv_freq.shape[-1]
    k, tail = k[..., :d], k[..., d:]
    if layout == "split_half":
        z = torch.complex(k[..., : d // 2], k[..., d // 2 :])
    else:
        z = torch.complex(k[..., 0::2], k[..., 1::2])
    angle = delta.double()[:, None] * inv_freq.double()[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)
    if layout == "split_half":
        return torch.cat([z.real, z.imag, tail], dim=-1)
    return torch.cat([torch.stack([z.real, z.imag], dim=-1).flatten(-2), tail], dim=-1)


def _sync_length(layer) -> None:
    """A sliding-window layer (Gemma3's local layers) counts the tokens it has seen for its mask: after columns leave
    or return, that is the columns it holds (exact while the session stays within the window)."""
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length = layer.keys.shape[-2]


class ReferenceSession:
    """Sequential replay of append / drop / reposition / refresh / evict / rehydrate on transformers' DynamicCache
    (no eviction policy: evictions and rehydrations are taken from the history).

    `inv_freq` / `layout`: one float64 frequency vector and layout for every layer, or one entry per layer, where an
    `inv_freq` of None marks a layer that applies no RoPE (its keys stay as they are on a reposition)."""

    def __init__(self, model, inv_freq: torch.Tensor | list[torch.Tensor | None],
                 layout: str | list[str] = "split_half"):
        n = model.config.num_hidden_layers
        self.model = model
        self.inv_freq = list(inv_freq) if isinstance(inv_freq, (list, tuple)) else [inv_freq] * n
        self.layout = list(layout) if isinstance(layout, (list, tuple)) else [layout] * n
        if len(self.inv_freq) != n or len(self.layout) != n:
            raise ValueError(f"give one inv_freq and layout per layer ({n}), or one for all")
        self.cache = DynamicCache(config=model.config)
        self.logical: list[int] = []
        self.tokens: list[int] = []  # every logical token
        self.positions: list[int] = []
        self.next_pos = 0
        self.n_logical = 0
        self.evicted: dict[int, tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}  # logical -> (pos, [K, V])
        self.hidden: set[tuple[int, int]] = set()  # per-head selection: (logical, layer * Hkv + KV head) not seen

    @torch.inference_mode()
    def append(self, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        pos = torch.arange(self.next_pos, self.next_pos + n)[None]
        if self.hidden:
            out = self._append_masked(tokens, pos)
        else:
            out = self.model(input_ids=torch.tensor([tokens]), position_ids=pos, past_key_values=self.cache,
                             use_cache=True)
        self.logical += list(range(self.n_logical, self.n_logical + n))
        self.tokens += list(tokens)
        self.positions += pos[0].tolist()
        self.n_logical += n
        self.next_pos += n
        return out.logits[0].float()

    def _append_masked(self, tokens: list[int], pos: torch.Tensor):
        """The forward with per-layer, per-query-head masks: causal among the new tokens, and each (layer, KV head)'s
        hidden columns masked for that KV head's query heads."""
        cfg = self.model.config
        n_layers, hq = cfg.num_hidden_layers, cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or hq
        g = hq // hkv
        q, n_old = len(tokens), len(self.logical)
        col = {lg: i for i, lg in enumerate(self.logical)}
        base = torch.zeros(q, n_old + q, dtype=torch.float32)
        base[:, n_old:] = torch.full((q, q), float("-inf")).triu(1)
        masks = [base.expand(1, hq, q, n_old + q).clone() for _ in range(n_layers)]
        for lg, head in self.hidden:
            layer, kv = divmod(head, hkv)
            masks[layer][0, kv * g : (kv + 1) * g, :, col[lg]] = float("-inf")
        previous = cfg._attn_implementation
        cfg._attn_implementation = MASKED
        try:
            return self.model(input_ids=torch.tensor([tokens]), position_ids=pos, past_key_values=self.cache,
                              use_cache=True, reference_masks=[m.to(self.model.dtype) for m in masks])
        finally:
            cfg._attn_implementation = previous

    def hide(self, pairs: list[list[int]]) -> None:
        """Per-head selection: (logical, layer * Hkv + KV head) pairs that head no longer sees."""
        self.hidden |= {(int(lg), int(h)) for lg, h in pairs}

    @classmethod
    def with_rope(cls, model, rope) -> ReferenceSession:
        """A reference rotating each layer as `rope` (a `ModelRope`) says, e.g. the engine's probed spec."""
        layers = getattr(rope, "layers", None) or [rope] * model.config.num_hidden_layers
        return cls(model, [s.inv_freq if s is not None else None for s in layers],
                   [s.layout if s is not None else "split_half" for s in layers])

    def _layers(self):
        return self.cache.layers

    def drop(self, indices: list[int]) -> None:
        gone = set(indices)
        keep = torch.tensor([i for i, lg in enumerate(self.logical) if lg not in gone], dtype=torch.long)
        for layer in self._layers():
            layer.keys = layer.keys[:, :, keep]
            layer.values = layer.values[:, :, keep]
            _sync_length(layer)
        self.logical = [self.logical[i] for i in keep.tolist()]
        self.positions = [self.positions[i] for i in keep.tolist()]
        self.hidden = {(lg, h) for lg, h in self.hidden if lg not in gone}

    def evict(self, indices: list[int]) -> None:
        """Like drop, but the columns are kept aside (position and per-layer K/V) for a later rehydrate."""
        where = {lg: i for i, lg in enumerate(self.logical)}
        for lg in indices:
            i = where[lg]
            self.evicted[lg] = (self.positions[i], [(layer.keys[:, :, i].clone(), layer.values[:, :, i].clone())
                                                    for layer in self._layers()])
        self.drop(indices)

    def rehydrate(self, indices: list[int]) -> None:
        """Put evicted columns back, in logical order, with the K/V and position they left with."""
        for lg in indices:
            pos, kv = self.evicted.pop(lg)
            at = sum(1 for x in self.logical if x < lg)
            for layer, (k, v) in zip(self._layers(), kv, strict=True):
                layer.keys = torch.cat([layer.keys[:, :, :at], k[:, :, None], layer.keys[:, :, at:]], dim=2)
                layer.values = torch.cat([layer.values[:, :, :at], v[:, :, None], layer.values[:, :, at:]], dim=2)
                _sync_length(layer)
            self.logical.insert(at, lg)
            self.positions.insert(at, pos)

    def reposition(self) -> None:
        r = len(self.logical)
        delta = torch.arange(r) - torch.tensor(self.positions)
        for layer, inv_freq, layout in zip(self._layers(), self.inv_freq, self.layout, strict=True):
            if inv_freq is not None:
                layer.keys = rotate_complex(layer.keys, delta, inv_freq, layout).to(layer.keys.dtype)
        self.positions = list(range(r))
        self.next_pos = r

    @torch.inference_mode()
    def refresh(self) -> torch.Tensor:
        """A new cache holding the resident tokens encoded afresh at 0..r-1 (one forward); returns its last logits."""
        r = len(self.logical)
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=torch.tensor([[self.tokens[i] for i in self.logical]]),
                         position_ids=torch.arange(r)[None], past_key_values=self.cache, use_cache=True)
        self.positions = list(range(r))
        self.next_pos = r
        return out.logits[0, -1].float()

    def replay(self, history: list[dict]) -> torch.Tensor | None:
        """Replay an engine op history (evict = drop keeping the columns aside, rehydrate = put them back,
        renumber ≡ reposition); returns the logits of the last append (or refresh)."""
        logits = None
        for op in history:
            kind = op["op"]
            if kind == "append":
                logits = self.append(op["tokens"])
            elif kind == "drop":
                self.drop(op["indices"])
            elif kind == "evict":
                self.evict(op["indices"])
            elif kind == "hide":
                self.hide(op["pairs"])
            elif kind == "rehydrate":
                self.rehydrate(op["indices"])
            elif kind in ("reposition", "renumber"):
                self.reposition()
            elif kind == "refresh":
                logits = self.refresh()[None]
            else:
                raise ValueError(f"unknown op {kind!r} in history")
        return logits
