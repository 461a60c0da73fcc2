"""`OpRadixCache`: SGLang's `RadixCache` with drop and reposition nodes between token nodes (AKV's op-history tree).

A path from the root reads tokens and ops in history order: token nodes as in `RadixCache`, and an op node (a child
keyed `("kvsteward-op", *op)`) wherever the history applies an op after the tokens above it. Two requests share
nodes exactly as far as their histories agree, so they share state only up to the first differing token or op, and
a drop in one never touches what another matched. Every op node stores the whole KV row of the state after it
(`kv_row`, with the `positions` and logical indices of its entries); token nodes below it hold only their own slots.

- drop node: owns no slots; its row is the parent state's row minus the dropped tokens (slots shared with the
  ancestors, which its existence keeps from eviction: a node with a child is never an evictable leaf). The survivors
  keep their positions and the next position stays the parent state's (`next_position`), so tokens appended below
  it are computed at row index + `position_offset` (tokens dropped since the last reposition): `match_prefix` sets
  that offset on the request (`req.kvsteward_position_offset`) and the `ForwardBatch.init_new` hook
  (`kvsteward.serve.sglang.positions`) applies it.
- reposition node: a **position version** — owns new slots with K re-rotated to 0..r-1 and V copied; the original
  slots stay, unchanged, for every request that reads the pre-op state.

An op node is created (materialized) the first time a request's history reaches it — its parent state must be in
the tree, i.e. ops act at turn boundaries of earlier requests, which is how an agent loop (and the SideQuest drop
after the main thread's turn) sends them. A request whose pre-op state is not cached cannot be served exactly in
one SGLang prefill; it is served as plain tokens (its physical ids re-prefilled, cached as plain tokens, never under
the op path) and counted in `stats["reprefill"]`. Requests without ops behave exactly as in `RadixCache`.

Limits: page_size 1, no EAGLE bigram keys, no hierarchical cache, MHA pools in NHD layout, unquantized KV.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import time
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from kvsteward.kernels.rope import ModelRope, RopeSpec
from kvsteward.serve.engine.ops import OpsError
from kvsteward.serve.sglang.ops import HistoryStore, SglangRequest, parse_request
from kvsteward.serve.sglang.pool import check_pool, position_version
from kvsteward.serve.sglang.positions import OFFSET_ATTR
from kvsteward.serve.sglang.refusal import DEFER_ATTR, NO_DEFER_ATTR, REFUSAL_ATTR

logger = logging.getLogger(__name__)
_EMPTY = torch.empty(0, dtype=torch.int64)
FREE_MODES = ("lazy", "eager", "off")


class OpNode(TreeNode):
    """A drop or reposition in the tree. `key` has one (dummy) entry per owned slot, so `RadixCache`'s lock and
    eviction accounting, which counts `len(node.key)`, counts exactly the slots this node frees."""

    def __init__(self, op: tuple, kv_row: torch.Tensor, positions: torch.Tensor, logical: torch.Tensor,
                 owned: torch.Tensor, next_position: int, origin: torch.Tensor, origin_pos: torch.Tensor):
        super().__init__()
        self.op = op
        self.next_position = next_position  # where the first token appended below this node goes
        self.op_key = ("kvsteward-op", *op)
        self.kv_row, self.positions, self.logical = kv_row, positions, logical
        # per row entry: the slot holding the K the model wrote (in an ancestor token node, kept alive by this
        # node) and the position it was written at. Versions rotate from there, never from an earlier version, so a
        # chain of repositions in bf16 rounds once, not once per link (PACE's reference keys, without a copy).
        self.origin, self.origin_pos = origin, origin_pos
        self.value = owned
        self.key = RadixKey(array("q", [-1] * owned.numel()), extra_key="kvsteward-op")


@dataclass
class _Walk:
    """Where a request's history reached in the tree: the deepest op node (anchor) and the row so far."""

    anchor: TreeNode
    node: TreeNode
    namespace: str | None
    row: list[torch.Tensor] = field(default_factory=list)
    exact: bool = True
    why: str = ""  # what made the walk inexact (logged with the re-prefill)
    pre_op_tokens: int = 0  # inexact because an op's pre-op state is not cached whole: that state's logical length
    defer: bool = False  # inexact because a reposition found no room for its version (the pre-op state is cached)
    fork: bool = False  # a LoRA request (the aux manager): reads the base model's state, caches nothing of its own
    hold: str = ""  # the request asked to hold the state it leaves: "budget" (a seal), "always" (a rebuild)
    held: list = field(default_factory=list)  # held pre-op states this walk continues with an op

    @property
    def anchor_len(self) -> int:
        return self.anchor.kv_row.numel() if isinstance(self.anchor, OpNode) else 0

    @property
    def position_offset(self) -> int:
        """Position minus row index of every token below the anchor (tokens dropped since the last reposition)."""
        return self.anchor.next_position - self.anchor_len if isinstance(self.anchor, OpNode) else 0


class OpRadixCache(RadixCache):
    def __init__(self, params: CacheInitParams, rope: RopeSpec | ModelRope | None = None, plain_drop: bool = True,
                 free: str = "lazy", hold_fraction: float = 0.5, hold_ttl: float = 60.0):
        if params.page_size != 1:
            raise ValueError(f"kvsteward's tree cache needs page_size 1, got {params.page_size}")
        if params.is_eagle:
            raise ValueError("kvsteward's tree cache does not support EAGLE bigram keys")
        super().__init__(params)
        self.rope = rope
        self.plain_drop = plain_drop  # position offsets are applied in the forward (a drop needs no reposition)
        self.pool = self.token_to_kv_pool_allocator.get_kvcache() if self.token_to_kv_pool_allocator else None
        if self.pool is not None and rope is not None:
            check_pool(self.pool)
        if free not in FREE_MODES:
            raise ValueError(f"free must be one of {FREE_MODES}, got {free!r}")
        self.free = free  # when dead KV (dropped tokens, superseded versions) is freed: see `free_dead`
        self.stats = {"op_nodes": 0, "reprefill": 0, "refused": 0, "offset_requests": 0, "forks": 0,
                      "unknown_base": 0, "compactions": 0, "freed": 0, "compacted_miss": 0, "pinned": 0,
                      "refused_miss": 0, "held": 0, "hold_taken": 0, "hold_expired": 0,
                      "hold_over_budget": 0, "deferred": 0}
        self._op_set: set[OpNode] = set()  # every op node in the tree
        # compacted op nodes (re-parented under a chain key): reachable only through this index, so it has no cap
        self._compacted: dict[tuple, OpNode] = {}
        # anchor keys of op nodes removed by compaction (bounded): a later request for such a state is counted
        self._tombstones: OrderedDict[tuple, None] = OrderedDict()
        self._dead: tuple[list, int] | None = None  # (compaction candidates, dead slots under a lock), None = stale
        # retracted, unfinished requests: id(req) -> (weakref to req, pinned anchor); at most `max_pins`
        self._pins: OrderedDict[int, tuple[Any, TreeNode]] = OrderedDict()
        self.max_pins = 64
        # held seals (node -> (tokens, when)), oldest first, within `hold_budget` tokens, released after `hold_ttl` s
        # if no request took them; holds taken by requests, by id(req)
        self._holds: OrderedDict[TreeNode, tuple[int, float]] = OrderedDict()
        self.hold_ttl = hold_ttl
        self._held_tokens = 0
        size = getattr(self.token_to_kv_pool_allocator, "size", 0) if self.token_to_kv_pool_allocator else 0
        self.hold_budget = int(hold_fraction * size)
        self._taken: dict[int, tuple[Any, list]] = {}
        self._logged_stats: dict = {}
        self._walks: dict[int, _Walk] = {}  # id(req) -> its walk, from match_prefix until the req is released
        self.histories = HistoryStore()  # parsed histories by chained key: a turn sends only what is new
        # op nodes by (namespace, cache salt, chained key of the elements up to the op): a walk starts at the
        # deepest one the tree still holds, so its cost does not grow with the ops before it
        self._anchors: OrderedDict[tuple, OpNode] = OrderedDict()
        self.max_anchors = 65536

    def reset(self):
        """sglang's `flush_cache` (an idle server): a new root, so the locks held on the old tree are gone with it."""
        super().reset()
        for name in ("_holds", "_taken", "_pins"):
            if hasattr(self, name):
                getattr(self, name).clear()
        self._held_tokens = 0

    # -- request -> history ------------------------------------------------------------------------------------------
    def _history(self, params: MatchPrefixParams) -> SglangRequest | None:
        req = params.req
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None) if req is not None else None
        try:
            return parse_request(custom, params.key.extra_key, self.histories, lora_id=self._lora_id(req))
        except OpsError as e:  # a malformed history: serve the tokens as sent, never under an op path
            self.stats["refused"] += 1
            self.stats["unknown_base"] += e.param == "kvsteward.base"
            logger.warning("kvsteward: op history refused, serving as plain tokens: %s", e)
            return None

    @staticmethod
    def _lora_id(req: Any) -> str | None:
        return getattr(req, "lora_id", None) if req is not None else None

    # -- match -------------------------------------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        if params.req is not None:  # a re-match (e.g. after retraction) replaces the request's earlier walk
            self._walks.pop(id(params.req), None)
            setattr(params.req, OFFSET_ATTR, 0)
            setattr(params.req, REFUSAL_ATTR, None)
            setattr(params.req, DEFER_ATTR, None)
        self._sweep_pins()
        self._expire_holds()
        hist = self._history(params)
        if self.disable or hist is None:
            return super().match_prefix(params)
        if hist.position_offset and not self.plain_drop:
            self.stats["refused"] += 1
            logger.warning("kvsteward: a drop without reposition needs the position-offset hook, which this server "
                           "configuration does not support; serving as plain tokens")
            return super().match_prefix(params)
        tokens = params.key.token_ids
        phys = hist.physical_ids
        if array("q", tokens[: len(phys)]) != phys:
            self.stats["refused"] += 1
            logger.warning("kvsteward: input_ids are not the history's physical tokens; serving as plain tokens")
            return super().match_prefix(params)
        fork = self._lora_id(params.req) is not None
        # a fork reads the main's state only: its last message (the trigger) is computed with the adapter, even where
        # the tree holds the same tokens (e.g. the `<|im_start|>` the main's reply also starts with)
        limit = min(len(params.key), len(phys) - hist.last_message_len) if fork else len(params.key)
        walk = self.walk(hist, params.key, limit=limit)
        walk.fork, walk.hold = fork, hist.hold
        if walk.fork and not walk.exact:
            # the prefix the manager reads must be the base model's state; it is not cached, and a LoRA request
            # would compute it with the adapter on: served as sglang serves any LoRA request (its own namespace)
            self.stats["refused"] += 1
            logger.warning("kvsteward: an aux fork (LoRA request) whose base state is not cached: served as a plain "
                           "LoRA request (the prefix computed with the adapter, not shared)")
            return super().match_prefix(params)
        self.stats["forks"] += walk.fork
        if not walk.exact and hist.refuse_miss and walk.defer and params.req is not None \
                and not getattr(params.req, NO_DEFER_ATTR, False):
            # the state is cached but its reposition's version finds no room: the request waits for room (as sglang
            # holds back a request whose extend does not fit) instead of a re-prefill, which would need room too
            self.stats["deferred"] += 1
            setattr(params.req, DEFER_ATTR, walk.why)
            self._log_stats()
            return self._no_match()
        if not walk.exact and hist.refuse_miss and walk.pre_op_tokens and params.req is not None \
                and not getattr(params.req, "output_ids", None):
            # refused before any work (`kvsteward.serve.sglang.refusal` aborts it from the waiting queue): the client
            # re-sends the pre-op state, then this request (`ops.generate_exact`), which is then served exactly
            self.stats["refused_miss"] += 1
            setattr(params.req, REFUSAL_ATTR, (walk.pre_op_tokens, walk.why))
            logger.info("kvsteward: refused (miss=refuse): %s; the client re-sends the first %d tokens' state",
                        walk.why, walk.pre_op_tokens)
            self._log_stats()
            return self._no_match()
        if not walk.exact:
            # served as plain tokens: the physical ids re-prefilled at row positions 0..n-1 and cached as plain
            # tokens (a plain-drop history is then served as if repositioned; nothing gapped enters the tree)
            self.stats["reprefill"] += 1
            logger.warning("kvsteward: re-prefill (served as plain tokens, not the engine's state): %s", walk.why)
            if any((hist.namespace, params.key.cache_salt, chain) in self._tombstones for chain, _, _ in hist.op_chain):
                # an op state of its history was compacted into a later op's (its dead KV freed), and that later
                # state is still cached: this history cannot be served exactly
                self.stats["compacted_miss"] += 1
                logger.warning("kvsteward: a request continues an op state that was compacted (its dropped KV "
                               "freed): served as plain tokens (re-prefilled, not the engine's state)")
            self._log_stats()
            return super().match_prefix(params)
        if walk.position_offset != hist.position_offset:  # the tree's bookkeeping disagrees with the history's
            self.stats["refused"] += 1
            logger.error("kvsteward: op path offset %d != history offset %d; serving as plain tokens",
                         walk.position_offset, hist.position_offset)
            return super().match_prefix(params)
        if params.req is not None:
            self._walks[id(params.req)] = walk
            setattr(params.req, OFFSET_ATTR, walk.position_offset)
            if walk.held and not walk.fork:
                self._take_holds(params.req, walk.held)
            self.stats["offset_requests"] += bool(walk.position_offset)
        row = torch.cat(walk.row) if walk.row else _EMPTY.to(self.device)
        self._log_stats()
        return MatchResult(device_indices=row, last_device_node=walk.node, last_host_node=walk.node,
                           best_match_node=walk.node)

    def _no_match(self) -> MatchResult:
        """What a refused or deferred request matches: nothing (it is not admitted this round)."""
        return MatchResult(device_indices=_EMPTY.to(self.device), last_device_node=self.root_node,
                           last_host_node=self.root_node, best_match_node=self.root_node)

    def walk(self, hist: SglangRequest, key: RadixKey, limit: int) -> _Walk:
        """Follow `hist` from the root, creating op nodes whose parent state is fully cached. The last token segment
        is taken from `key` (it may run past the history: output ids of a retracted request). The row is cut to
        `limit` entries (SGLang recomputes at least the last token)."""
        walk = _Walk(anchor=self.root_node, node=self.root_node, namespace=hist.namespace)
        tokens = key.token_ids
        tail_start = len(hist.physical_ids) - len(hist.elements[-1][1])
        n_logical, first = 0, 0
        op_keys = {idx - 1: chain for chain, idx, _ in hist.op_chain}  # element index of an op -> its chained key
        for chain, idx, logical in reversed(hist.op_chain):  # the deepest op node the tree still holds
            akey = (hist.namespace, key.cache_salt, chain)
            node = self._anchors.get(akey) or self._compacted.get(akey)
            if node is not None and self._attached(node):
                if akey in self._anchors:
                    self._anchors.move_to_end(akey)
                walk.anchor = walk.node = node
                walk.row = [node.kv_row]
                n_logical, first = logical, idx
                break
        for k in range(first, len(hist.elements)):
            e = hist.elements[k]
            if e[0] == "tokens":
                if k == len(hist.elements) - 1:  # physical: the row SGLang gets is capped at `limit`
                    seg = tokens[tail_start:][: max(limit - sum(r.numel() for r in walk.row), 0)]
                else:  # logical tokens before an op: the whole segment must be cached for the op to apply
                    seg = e[1]
                seg_key = RadixKey(seg, hist.namespace, cache_salt=key.cache_salt)
                values, walk.node = self._match_prefix_helper(walk.node, seg_key) if len(seg_key) else ([], walk.node)
                matched = sum(v.numel() for v in values)
                walk.row.extend(v.to(torch.int64) for v in values)
                if matched < len(e[1]) and k < len(hist.elements) - 1:
                    walk.exact = False  # an op follows state that is not cached
                    walk.why = f"message segment {k}: {matched} of {len(e[1])} tokens cached before an op"
                    walk.pre_op_tokens = n_logical + len(e[1])
                    return walk
                if k < len(hist.elements) - 1 and walk.node in self._holds:
                    walk.held.append(walk.node)
                n_logical += matched
            else:
                child = walk.node.children.get(("kvsteward-op", *e))
                if child is None:
                    child = self._materialize(walk, e, n_logical)
                    if child is None:
                        walk.exact = False
                        walk.why = f"op {e[0]} at element {k} could not be materialized"
                        walk.defer = e[0] == "reposition"  # no room for its version now: room frees as requests end
                        return walk
                walk.node = walk.anchor = child
                walk.row = [child.kv_row]
                if k in op_keys:
                    self._remember((hist.namespace, key.cache_salt, op_keys[k]), child)
        # only the final state's row is the request's prefix (an earlier op state may be longer than the request:
        # drops after it shrink the row)
        if walk.anchor_len > limit:
            walk.exact = False
            walk.why = f"the op state's row ({walk.anchor_len}) is longer than the request ({limit})"
        return walk

    # -- ops ---------------------------------------------------------------------------------------------------------
    def _state(self, walk: _Walk, n_logical: int) -> tuple[torch.Tensor, ...]:
        """(row, positions, logical indices, next position, origin slots, origin positions) of the state the walk
        reached: the anchor's row, then token slots at positions (and logical indices) continuing from the anchor's
        next position (their own origins)."""
        anchor = walk.anchor
        row = torch.cat(walk.row) if walk.row else _EMPTY.to(self.device)
        if isinstance(anchor, OpNode):
            base, pos0, log0, next0 = anchor.kv_row.numel(), anchor.positions, anchor.logical, anchor.next_position
            first_logical = n_logical - (row.numel() - base)
            org0, opos0 = anchor.origin, anchor.origin_pos
        else:
            base, pos0, log0, next0, first_logical = 0, _EMPTY, _EMPTY, 0, 0
            org0, opos0 = _EMPTY.to(self.device), _EMPTY
        extra = row.numel() - base
        new_pos = next0 + torch.arange(extra, dtype=torch.int64)
        positions = torch.cat([pos0, new_pos])
        logical = torch.cat([log0, first_logical + torch.arange(extra, dtype=torch.int64)])
        origin, origin_pos = torch.cat([org0, row[base:]]), torch.cat([opos0, new_pos])
        return row, positions, logical, next0 + extra, origin, origin_pos

    def _materialize(self, walk: _Walk, op: tuple, n_logical: int) -> OpNode | None:
        row, positions, logical, next_position, origin, origin_pos = self._state(walk, n_logical)
        if op[0] == "drop":
            keep = ~torch.isin(logical, torch.tensor(op[1], dtype=torch.int64))
            kd = keep.to(row.device)
            node = OpNode(op, row[kd], positions[keep], logical[keep], _EMPTY.to(self.device), next_position,
                          origin[kd], origin_pos[keep])
        elif op[0] == "reposition":
            if self.rope is None or self.pool is None:
                logger.warning("kvsteward: no RoPE spec / KV pool, cannot reposition")
                return None
            new = self._alloc_version(walk.node, origin, origin_pos)
            if new is None:
                return None
            node = OpNode(op, new, torch.arange(row.numel(), dtype=torch.int64), logical, new, row.numel(),
                          origin, origin_pos)
        else:
            return None
        self._attach(walk.node, node)
        return node

    def _alloc_version(self, parent: TreeNode, row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """A position version of `row` (origin slots, at their origin `positions`), evicting unlocked leaves for room
        while the parent path — which holds the origins — is locked."""
        new = position_version(self.pool, self.token_to_kv_pool_allocator, row, positions, self.rope)
        if new is None:
            self.inc_lock_ref(parent)
            try:
                self.evict(EvictParams(num_tokens=row.numel()))
            finally:
                self.dec_lock_ref(parent)
            new = position_version(self.pool, self.token_to_kv_pool_allocator, row, positions, self.rope)
        return new

    def _attach(self, parent: TreeNode, node: OpNode) -> None:
        node.parent = parent
        parent.children[node.op_key] = node
        self.evictable_size_ += len(node.key)
        self.stats["op_nodes"] += 1
        self._op_set.add(node)
        self._dead = None
        self._update_leaf_status(parent)
        self._update_leaf_status(node)

    def _attached(self, node: OpNode) -> bool:
        """Whether `node` is still in the tree (an evicted op node is popped from its parent; its ancestors stay
        while it does: eviction frees leaves only)."""
        return node.parent is not None and node.parent.children.get(node.op_key) is node

    def _remember(self, key: tuple, node: OpNode) -> None:
        self._tombstones.pop(key, None)
        if self._anchors.get(key) is not node:
            self._anchors[key] = node
            node.anchor_keys = getattr(node, "anchor_keys", ()) + (key,)
        self._anchors.move_to_end(key)
        while len(self._anchors) > self.max_anchors:
            self._anchors.popitem(last=False)

    def _delete_leaf(self, node):
        self._dead = None
        if not isinstance(node, OpNode):
            return super()._delete_leaf(node)
        for key in getattr(node, "anchor_keys", ()):
            if self._anchors.get(key) is node:
                del self._anchors[key]
            if self._compacted.get(key) is node:
                del self._compacted[key]
        for key in getattr(node, "absorbed_keys", ()):  # evicted, not compacted: a miss on them is an eviction's
            self._tombstones.pop(key, None)
        self._op_set.discard(node)
        removed = node.parent.children.pop(node.op_key, None)
        assert removed is node, f"parent does not hold op node {node.op_key}"
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        self.stats["op_nodes"] -= 1
        self._update_leaf_status(node.parent)

    def evict(self, params: EvictParams) -> EvictResult:
        """`RadixCache.evict`, except that dead KV goes first (`free_dead`: dropped tokens and superseded versions no
        request or cached branch reads, locked or not), and op nodes emit no KV events (their keys are not token
        pages). Then unlocked leaves, least recently used first, as sglang does."""
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        num_evicted = 0
        while True:  # an evicted sibling branch can leave a chain dead: then its dead KV goes before more leaves
            dead = self.free_dead(params.num_tokens - num_evicted)
            num_evicted += dead
            leaves, nodes = self._evict_leaves(params.num_tokens - num_evicted)
            num_evicted += leaves
            if num_evicted >= params.num_tokens or not (nodes and self.free != "off"):
                break
        self.update_eviction_metrics(num_evicted, start_time)
        return EvictResult(num_tokens_evicted=num_evicted)

    def _evict_leaves(self, num_tokens: int) -> tuple[int, int]:
        """Unlocked leaves, least recently used first, until `num_tokens` slots are freed: (slots, nodes) evicted."""
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted = nodes = 0
        while num_evicted < num_tokens and heap:
            _, x = heapq.heappop(heap)
            nodes += 1
            self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)
            num_evicted += len(x.value)
            self._delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0 and x.parent is not self.root_node:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
            if not isinstance(x, OpNode):
                self.kv_events.record_remove(x)
        return num_evicted, nodes

    # -- caching a request's KV ---------------------------------------------------------------------------------------
    def _insert_tail(self, req: Any, walk: _Walk, token_ids: Any, kv_indices: torch.Tensor,
                     chunked: bool = False) -> tuple[int, TreeNode]:
        """Insert the request's tokens after its anchor (the last op) under that anchor: returns (end of the
        part that was already cached, as a row index; last node)."""
        off = walk.anchor_len
        key = RadixKey(array("q", token_ids[off:]), walk.namespace, cache_salt=req.cache_salt)
        values = kv_indices[off:].to(dtype=torch.int64, copy=True)
        prefix_len, node = self._insert_helper(walk.anchor, key, values, getattr(req, "priority", 0) or 0, chunked)
        return off + prefix_len, node

    def insert_req(self, req: Any, *, up_to: int):
        """sglang 0.5.21's finish path (`mem_cache.common.release_kv_cache`): hand the request's KV up to row position
        `up_to` to the tree and advance `cache_protected_len` past it; the caller then frees the row from
        `cache_protected_len` on, unpins (`dec_lock_ref(req.last_node)`) and calls `on_release`. Under an op path the
        tail goes below the request's last op node (its anchor), never under plain token keys from the root."""
        walk = self._walks.get(id(req))
        if walk is None or self.disable:
            return super().insert_req(req, up_to=up_to)
        if walk.fork:  # the fork's own tokens were computed with the adapter: the caller frees them
            return
        token_ids = (req.origin_input_ids + req.output_ids)[:up_to]
        kv_indices = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
        freed_end, node = self._insert_tail(req, walk, token_ids, kv_indices)
        if walk.hold:
            self._hold(node, len(token_ids), always=walk.hold == "always")
        protected = req.kv.cache_protected_len
        # the new slots of tokens the tree already held are duplicates; the tree owns everything else now
        self.token_to_kv_pool_allocator.free_segment(kv_indices[protected:freed_end], start_pos=protected)
        req.kv.cache_protected_len = len(token_ids)

    def on_release(self, req: Any, *, inserted: bool) -> None:
        walk = self._walks.pop(id(req), None)
        self._unpin(id(req))
        self._release_taken(id(req))
        if not inserted and walk is not None and not walk.fork and isinstance(walk.anchor, OpNode) \
                and not _finished(req) and self._attached(walk.anchor):
            self._pin(req, walk.anchor)
        super().on_release(req, inserted=inserted)
        if self.free == "eager":
            self.free_dead()

    # -- retraction: the anchor of a released, unfinished request stays ---------------------------------------------
    def _pin(self, req: Any, node: TreeNode) -> None:
        """sglang retracts a running request by releasing its row and lock without inserting anything
        (`release_kv_cache(is_insert=False)`) and re-matches it later. Its anchor (the op state its history reached)
        is pinned until then, so re-admission continues that state exactly instead of re-prefilling the survivors.
        Bounded: beyond `max_pins`, the oldest pin goes first."""
        try:
            ref = weakref.ref(req)
        except TypeError:
            return
        self.inc_lock_ref(node)
        self._pins[id(req)] = (ref, node)
        self.stats["pinned"] += 1
        while len(self._pins) > self.max_pins:
            self._unpin(next(iter(self._pins)))

    def _unpin(self, key: int) -> None:
        pin = self._pins.pop(key, None)
        if pin is not None:
            self.dec_lock_ref(pin[1])

    def _sweep_pins(self) -> None:
        """Pins and taken holds of requests that no longer exist (aborted while waiting) are released."""
        for key in [k for k, (ref, _) in self._pins.items() if ref() is None]:
            self._unpin(key)
        for key in [k for k, (ref, _) in self._taken.items() if ref() is None]:
            self._release_taken(key)

    # -- holds: a sealed pre-op state stays until the op request that continues it is released -----------------------
    def _hold(self, node: TreeNode, tokens: int, always: bool = False) -> None:
        """A seal (`hold: true`) just cached the state an op request will continue. Under memory pressure sglang
        would evict it as soon as other requests need room, before that request is admitted (a cyclic pattern:
        least recently used is the next one needed), and the op request would then miss it. It is locked instead,
        until a walk continues it with an op (`_take_holds`: the lock passes to that request, released with it).
        Bounded: held tokens stay within `hold_budget`, first come first held (a seal that does not fit is not held:
        under FCFS admission the earliest held states are the next ones continued, so expiring them for a newer one
        would evict what is needed first). A rebuild (`always`: its request was refused once and waits for it) is held
        past the budget (it still counts), so a rebuilt state is not evicted again before its request comes back. A
        hold no request took within `hold_ttl` seconds is released (its client went away), and the scheduler hook
        releases every hold when they keep the queue's head out (`refusal.abort_refused`)."""
        if node is self.root_node or node in self._holds:
            return
        self._expire_holds()
        if not always and self._held_tokens + tokens > self.hold_budget:
            self.stats["hold_over_budget"] += 1
            return
        self.inc_lock_ref(node)
        self._holds[node] = (tokens, time.monotonic())
        self._held_tokens += tokens
        self.stats["held"] += 1

    def _release_oldest_hold(self) -> None:
        node, (tokens, _) = self._holds.popitem(last=False)
        self._held_tokens -= tokens
        self.dec_lock_ref(node)

    def _expire_holds(self) -> None:
        deadline = time.monotonic() - self.hold_ttl
        while self._holds and next(iter(self._holds.values()))[1] < deadline:
            self.stats["hold_expired"] += 1
            self._release_oldest_hold()

    def release_holds(self, taken: bool = False) -> int:
        """Release every hold no request has taken yet, and with `taken` the holds waiting requests took too (they
        become evictable): the number released."""
        n = len(self._holds)
        while self._holds:
            self._release_oldest_hold()
        if taken:
            for key in list(self._taken):
                n += len(self._taken[key][1])
                self._release_taken(key)
        return n

    def _take_holds(self, req: Any, nodes: list) -> None:
        try:
            ref = weakref.ref(req)
        except TypeError:
            return
        taken = self._taken.setdefault(id(req), (ref, []))[1]
        for node in nodes:
            held = self._holds.pop(node, None)
            if held is not None:
                self._held_tokens -= held[0]
                taken.append(node)  # the lock now lives as long as the request
                self.stats["hold_taken"] += 1

    def _release_taken(self, key: int) -> None:
        entry = self._taken.pop(key, None)
        for node in entry[1] if entry else ():
            self.dec_lock_ref(node)

    # -- freeing dead KV: lazy path compaction with ownership transfer ------------------------------------------------
    def inc_lock_ref(self, node: TreeNode):
        self._dead = None
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode, params: Any = None):
        self._dead = None
        return super().dec_lock_ref(node, params)

    def _insert_helper(self, node, key, value, priority: int = 0, chunked: bool = False):
        self._dead = None
        return super()._insert_helper(node, key, value, priority, chunked)

    def _split_node(self, key, child, split_len: int):
        self._dead = None
        return super()._split_node(key, child, split_len)

    def _pass_through(self, x: TreeNode, child: TreeNode) -> bool:
        """No request ends at `x`, no other branch continues it: its only child carries every lock it has."""
        return x is not self.root_node and x.parent is not None and not x.evicted and len(x.children) == 1 \
            and x.lock_ref == child.lock_ref

    def _candidates(self) -> tuple[list, int]:
        """Compaction candidates [(op node, its run, run-owned slots, keep mask)] — only the deepest op node of each
        dead chain (a run may hold earlier op nodes, whose own runs it contains) — and the dead slots under a lock
        (advertised as evictable). Recomputed after any change of the tree or its locks, in time linear in the nodes
        above op nodes: each op node's segment (the pass-through token nodes up to the next op node) is walked once,
        and a chain's run is the concatenation of its segments."""
        if self._dead is not None:
            return self._dead
        segments: dict[OpNode, tuple[list[TreeNode], OpNode | None]] = {}
        inner: set[OpNode] = set()
        for n in self._op_set:
            nodes, child, x, up = [], n, n.parent, None
            while x is not None and self._pass_through(x, child):
                if isinstance(x, OpNode):  # a pass-through op node: the chain continues with its own segment
                    up = x
                    break
                nodes.append(x)
                child, x = x, x.parent
            segments[n] = (nodes, up)
            if up is not None and getattr(n, "anchor_keys", ()):
                inner.add(up)
        cands, locked_dead = [], 0
        for n in self._op_set:
            if n in inner or not getattr(n, "anchor_keys", ()):  # unreachable once re-parented: never compacted
                continue
            run, up = list(segments[n][0]), segments[n][1]
            while up is not None:
                run.append(up)
                nodes, up = segments[up]
                run.extend(nodes)
            if not run:
                continue
            owned = torch.cat([x.value.to(torch.int64) for x in run])
            need = torch.cat([n.kv_row, n.origin]).to(owned.device)
            keep = torch.isin(owned, need)
            dead = int(owned.numel() - int(keep.sum()))
            if dead:
                cands.append((n, run, owned, keep))
                locked_dead += dead if n.lock_ref > 0 else 0
        self._dead = (cands, locked_dead)
        return self._dead

    def dead_size(self) -> int:
        """Slots held by the tree that no request, cached branch or later op needs (all of them, locked or not)."""
        return sum(int(owned.numel() - int(keep.sum())) for _, _, owned, keep in self._candidates()[0])

    def evictable_size(self):
        """sglang's evictable count plus the dead slots under a lock: `evict` frees them first, so admission
        (`available + evictable`) and the `/v1/loads` used count see them as free-on-demand. The sum with
        `protected_size` is unchanged (sglang's accounting equation)."""
        return self.evictable_size_ + (self._candidates()[1] if self.free != "off" else 0)

    def protected_size(self):
        return self.protected_size_ - (self._candidates()[1] if self.free != "off" else 0)

    def free_dead(self, num_tokens: int | None = None) -> int:
        """Compact dead chains, least recently used first, until `num_tokens` slots are freed (all, if None): returns
        the number freed. `eager` mode calls it after every release; `lazy` (the default) from `evict`, i.e. when
        sglang needs room."""
        if self.free == "off" or (num_tokens is not None and num_tokens <= 0):
            return 0
        cands = sorted(self._candidates()[0], key=lambda c: self.eviction_strategy.get_priority(c[0]))
        freed = 0
        for cand in cands:
            if num_tokens is not None and freed >= num_tokens:
                break
            freed += self._compact(*cand)
        return freed

    def _compact(self, node: OpNode, run: list[TreeNode], owned: torch.Tensor, keep: torch.Tensor) -> int:
        """Path compaction: the slots of `run` that `node` needs (its row and the origins its versions rotate from,
        which also cover every descendant's) move into `node.value`; the rest are freed, once; the run's nodes leave
        the tree and `node` is re-parented under the run's parent, keyed by its chained history key. Nothing any
        request holds changes (row slot ids stay; locks along the run equal the node's, so no request ends in it)."""
        top = run[-1]
        parent = top.parent
        freed, moved = owned[~keep], owned[keep]
        absorbed = list(getattr(node, "absorbed_keys", ()))
        for x in run:
            self.evictable_leaves.discard(x)
            if isinstance(x, OpNode):
                absorbed += list(getattr(x, "anchor_keys", ())) + list(getattr(x, "absorbed_keys", ()))
                for key in getattr(x, "anchor_keys", ()):
                    if self._anchors.get(key) is x:
                        del self._anchors[key]
                    if self._compacted.get(key) is x:
                        del self._compacted[key]
                    self._tombstone(key)
                self._op_set.discard(x)
                self.stats["op_nodes"] -= 1
            else:
                self.kv_events.record_remove(x)
        for k, c in list(parent.children.items()):
            if c is top:
                del parent.children[k]
                break
        if node.lock_ref > 0:
            self.protected_size_ -= freed.numel()
        else:
            self.evictable_size_ -= freed.numel()
        self.token_to_kv_pool_allocator.free(freed.to(self.device))
        node.value = torch.cat([node.value.to(torch.int64), moved.to(node.value.device)])
        node.key = RadixKey(array("q", [-1] * node.value.numel()), extra_key="kvsteward-op")
        node.absorbed_keys = tuple(absorbed)  # the op states compacted into this one
        for key in node.anchor_keys:
            self._compacted[key] = node
        node.op_key = ("kvsteward-chain", *node.anchor_keys[-1])
        node.parent = parent
        parent.children[node.op_key] = node
        for x in run:
            x.parent, x.children = None, {}
        self._update_leaf_status(parent)
        self._update_leaf_status(node)
        self._dead = None
        self.stats["compactions"] += 1
        self.stats["freed"] += int(freed.numel())
        return int(freed.numel())

    def _tombstone(self, key: tuple) -> None:
        self._tombstones[key] = None
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > self.max_anchors:
            self._tombstones.popitem(last=False)

    def _log_stats(self) -> None:
        """One `kvsteward tree stats` line whenever the counters change (the benchmark reads the last one)."""
        if self.stats != self._logged_stats:
            self._logged_stats = dict(self.stats)
            logger.info("kvsteward tree stats: %s", json.dumps(self.stats, sort_keys=True))

    def cache_unfinished_req(self, req: Any, chunked: bool = False):
        walk = self._walks.get(id(req))
        if walk is None or self.disable:
            return super().cache_unfinished_req(req, chunked=chunked)
        if walk.fork:  # as sglang's ChunkCache: the request keeps its own row, nothing enters the tree
            n = len(req.get_fill_ids())
            req.prefix_indices = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64,
                                                                                                copy=True)
            return
        token_ids = req.get_fill_ids()
        kv_indices = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
        new_end, new_last = self._insert_tail(req, walk, token_ids, kv_indices, chunked=chunked)
        protected = req.kv.cache_protected_len
        self.token_to_kv_pool_allocator.free_segment(kv_indices[protected:new_end], start_pos=protected)
        # re-read the row from the tree: slots of tokens that were already cached are the tree's
        node, parts = new_last, []
        while node is not walk.anchor:
            parts.append(node.value)
            node = node.parent
        tree_row = torch.cat([walk.anchor.kv_row if isinstance(walk.anchor, OpNode) else _EMPTY.to(self.device),
                              *reversed(parts)])
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, tree_row.numel())),
                                     tree_row[protected:].to(torch.int32))
        req.kv.cache_protected_len = tree_row.numel()
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last)
        req.prefix_indices = torch.cat([tree_row, kv_indices[tree_row.numel():].to(torch.int64)])
        req.last_node = new_last
        walk.node = new_last


def create_tree_cache(ctx: Any) -> OpRadixCache:
    """`register_radix_cache_backend` factory: an `OpRadixCache` with the model's RoPE spec (float64)."""
    if ctx.enable_hierarchical_cache or ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        raise ValueError("--radix-cache-backend kvsteward supports plain MHA models without hierarchical cache "
                         "(no SWA / Mamba / DSA hybrids, no --enable-hierarchical-cache)")
    free = os.environ.get("KVSTEWARD_FREE", "lazy")
    hold = float(os.environ.get("KVSTEWARD_HOLD", "0.5"))
    if not 0 <= hold < 1:
        raise ValueError(f"KVSTEWARD_HOLD must be a fraction of the pool in [0, 1), got {hold}")
    ttl = float(os.environ.get("KVSTEWARD_HOLD_TTL", "60"))
    return OpRadixCache(ctx.params, rope=model_rope_spec(ctx.model_config), plain_drop=plain_drop_supported(ctx),
                        free=free, hold_fraction=hold, hold_ttl=ttl)


def _finished(req: Any) -> bool:
    finished = getattr(req, "finished", None)
    return bool(finished()) if callable(finished) else False


def plain_drop_supported(ctx: Any) -> bool:
    """A drop without reposition needs the `ForwardBatch.init_new` position hook, applied in this process, and a
    server whose positions all come from `init_new`'s row-index rule (no speculative decoding, dLLM, M-RoPE or
    decode context parallelism). Otherwise such requests are served as plain tokens (counted as refused)."""
    from kvsteward.serve.sglang.positions import hook_applied

    args = getattr(ctx, "server_args", None)
    reasons = []
    if not hook_applied():
        reasons.append("the ForwardBatch.init_new position hook is not applied (load the plugin: SGLANG_PLUGINS)")
    if args is not None and getattr(args, "speculative_algorithm", None):
        reasons.append("speculative decoding")
    if args is not None and getattr(args, "dllm_algorithm", None):
        reasons.append("dLLM")
    if args is not None and (getattr(args, "dcp_size", 1) or 1) > 1:
        reasons.append("decode context parallelism")
    if getattr(ctx.model_config, "model_is_mrope", False):
        reasons.append("M-RoPE")
    if reasons:
        logger.warning("kvsteward: drops without reposition are served as plain tokens: %s", "; ".join(reasons))
    return not reasons


# Model types whose SGLang rotary code is verified to be rope_spec(config, "split_half") on every layer: split-half
# (neox style, get_rope's default) over the whole head (sglang/srt/models/{llama,mistral,qwen2,qwen3,qwen2_moe,
# qwen3_moe}.py). Other families differ in ways the config alone does not say (GLM / ChatGLM / GPT-J / Cohere:
# interleaved; Qwen2 ignores a partial_rotary_factor that SGLang's Llama applies): without KVSTEWARD_ROPE_LAYOUT they
# re-prefill. (sglang 0.5.21 has no SmolLM3; later releases' smollm3.py is Llama's attention without rotary_emb on the
# `no_rope_layers`, which `config_model_rope` reads.)
_SGLANG_SPLIT_HALF_FULL_HEAD = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _unverified_rope(config: Any, rope: ModelRope) -> str | None:
    """Why the split-half guess is not known to be SGLang's own rotation for this config, or None."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _SGLANG_SPLIT_HALF_FULL_HEAD:
        return f"model type {model_type!r} has no verified RoPE layout in SGLang"
    if getattr(config, "rope_is_neox_style", True) is False:
        return f"{model_type} with rope_is_neox_style=False (interleaved in SGLang)"
    partial = [s for s in rope.specs if s.rotary_dim != s.head_dim]
    if partial:
        return (f"{model_type} with partial rotary ({partial[0].rotary_dim} of {partial[0].head_dim} dims): "
                f"unverified in SGLang")
    return None


def model_rope_spec(model_config: Any) -> ModelRope | None:
    """The float64 RoPE spec of each layer of the served model, or None (then repositions fall back to re-prefill).

    Read from the HF config (`config_model_rope`: SmolLM3's `no_rope_layers` keep their keys, Gemma3-style rope
    parameters nested by layer type give each layer its type's spec). KVSTEWARD_ROPE_LAYOUT (split_half |
    interleaved) states the layout; unset, only the families whose SGLang code is verified split-half over the whole
    head get a spec: a wrong guess would silently re-rotate to wrong keys."""
    import os

    from kvsteward.kernels.rope import UnsupportedRope, config_model_rope

    layout = os.environ.get("KVSTEWARD_ROPE_LAYOUT")  # SGLang's neox style = HF rotate_half = "split_half"
    try:
        config = model_config.hf_text_config if hasattr(model_config, "hf_text_config") else model_config.hf_config
        rope = config_model_rope(config, layout=layout or "split_half")
        why = None if layout else _unverified_rope(config, rope)
        if why:
            raise UnsupportedRope(f"{why}; set KVSTEWARD_ROPE_LAYOUT=split_half or interleaved once checked against "
                                  f"SGLang's model code")
        return rope
    except (UnsupportedRope, AttributeError) as e:
        logger.warning("kvsteward: no exact re-rotation for this model (%s): reposition ops will re-prefill", e)
        return None
