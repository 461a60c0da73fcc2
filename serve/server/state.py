"""The shared prefix cache: a trie keyed by the session config and the message-level op sequence (AKV §4.2).

A path from the root is a sequence of ops `("append", kind, tokens)` / `("drop", messages)` / `("reposition",)`
(see `kvsteward.serve.engine.ops`); a node may hold the engine state reached by exactly that path. A request walks its
own op sequence, takes the deepest node holding a state, forks it (an independent copy) and applies only the rest, so
two requests share state exactly up to the first token or op that differs, and a drop in one request never changes
another's state (the cache only ever hands out copies).

Memory is bounded by the bytes the held states allocate: states that a held continuation has superseded through a
drop go first (their dropped KV serves only requests that do not drop), then least-recently-used ones; a state being
forked right now (pinned) never goes, and emptied nodes stay while they lead to other states so those remain findable.

Compatible matches (position versions, AKV §4.2.3 / A.1.2): a held state reached by the request's prefix P followed
only by `("reposition",)` ops is the same computation as state(P) with its keys stored at compacted positions. When
no exact state is at least as deep, the lookup forks it and `unreposition` turns the fork into state(P): positions
from replaying the engine history's position bookkeeping (no model forward), K re-rotated from the fp32 reference
keys, next position, renumber count and history restored. A reposition that precedes a later op is never stripped
(AKV Figure 11: it changed the hidden states of every token computed after it).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

from kvsteward.serve.engine.ops import Op

REPOSITION: Op = ("reposition",)


@dataclass(eq=False)
class _Node:
    key: Op | None = None
    parent: _Node | None = None
    children: dict = field(default_factory=dict)
    state: object | None = None  # a Session owned by the cache (never mutated after insertion)
    nbytes: int = 0
    last_used: float = 0.0
    pins: int = 0
    depth: int = 0  # ops from the root


def compact_copy(session):
    """A fork whose slot table holds exactly the resident slots (no spare capacity): what the cache stores."""
    copy = session.fork()
    t = copy.table
    n = t.n
    t.k = [k[:, :n].clone() for k in t.k]
    t.v = [v[:, :n].clone() for v in t.v]
    if t.ref_k is not None:
        t.ref_k = [r[:, :n].clone() for r in t.ref_k]
    t.meta = {name: m[:n].clone() for name, m in t.meta.items()}
    t.capacity = n
    return copy


def replay_positions(history: list[dict]) -> tuple[dict[int, int], int]:
    """Physical position of every resident logical token, and the next position, after the engine `history`: the
    restore planner's metadata-only simulation of the history (no forward)."""
    from kvsteward.serve.engine.restore import plan_history

    plan = plan_history(history)
    return dict(zip(plan.resident, plan.final_pos, strict=True)), plan.next_pos


def trailing_repositions(history: list[dict]) -> int:
    """How many `reposition` entries end the engine history (renumbers are not counted: they belong to an append)."""
    k = 0
    while k < len(history) and history[-1 - k] == {"op": "reposition"}:
        k += 1
    return k


def unreposition(session, k: int) -> None:
    """Undo the last `k` repositions of `session` in place (it must be a private fork): the state before them.

    Only trailing repositions can be undone exactly: they moved keys and nothing else (no forward ran after them).
    Keys get the positions that replaying the earlier history's bookkeeping gives, as R(p - p_ref) K_ref from the
    fp32 reference keys (K_ref itself where p = p_ref); the fp32 reference keys are dropped again when the earlier
    history never moved a key, as in a fresh build. Raises ValueError (session unchanged) when the history does not
    end in k repositions or the replayed residents differ from the table's.
    """
    from kvsteward.serve.engine.restore import plan_history
    from kvsteward.serve.engine.session import move_resident

    if not 1 <= k <= trailing_repositions(session.history):
        raise ValueError(f"the history does not end in {k} reposition(s)")
    base = session.history[:-k]
    plan = plan_history(base)
    pos = dict(zip(plan.resident, plan.final_pos, strict=True))
    t = session.table
    logical = t.field("logical").tolist()
    if logical != sorted(pos):
        raise ValueError("the replayed history does not give the resident slots of this state")
    new_pos = torch.tensor([pos[i] for i in logical], dtype=torch.long, device=t.device)
    move_resident(t, session.engine.rope, new_pos)
    if not plan.renumbers:
        t.ref_k = None  # a fresh build takes reference keys at its first move; p = p_ref here, so K = K_ref exactly
    session.next_pos = plan.next_pos
    session.renumbers = plan.renumbers
    session.fresh_rows = 0  # (only a tail refresh reads it: re-encode everything rather than reason about the undo)
    session.history = list(base)


@dataclass
class Match:
    """A lookup's result: `session` (a private fork, or None), `depth` (request ops it covers), `kind`
    ("exact", "compatible" or "miss") and, for a compatible match, the trailing repositions undone."""

    session: object | None
    depth: int
    kind: str
    repositions: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int, metrics=None):
        self.max_bytes = max_bytes
        self.metrics = metrics
        self._roots: dict[object, _Node] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.states = 0
        self.resident_tokens = 0
        self.evictions = 0
        self.compatible_hits = 0

    # -- lookup ---------------------------------------------------------------------------------------------------
    def lookup_fork(self, root_key, ops: list[Op], lock=None):
        """(fork of the deepest usable cached state on the path of `ops`, its depth) or (None, 0); see `lookup`."""
        match = self.lookup(root_key, ops, lock)
        return match.session, match.depth

    def lookup(self, root_key, ops: list[Op], lock=None, compatible: bool = True) -> Match:
        """The deepest exact state on the path of `ops`, or a strictly deeper compatible one.

        Exact: a node on the path holds a state. Compatible: the node at depth d' on the path (ops[:d'] matched,
        so the walk still stops at the first differing token or op) has a chain of only `("reposition",)` children
        ending in a held state; its fork, un-repositioned, is state(ops[:d']). Ties go to the exact state. `lock`
        (the engine's compute lock) is held while a compatible fork is re-rotated, like a reposition op.
        `compatible=False`: exact states only.
        """
        with self._lock:
            node = self._roots.get(root_key)
            exact, compat, reps = None, None, 0
            for depth in range(len(ops) + 1):
                if node is None:
                    break
                if depth and node.state is not None:
                    exact = node
                holder, k = node.children.get(REPOSITION), 1
                while holder is not None and holder.state is None:
                    holder, k = holder.children.get(REPOSITION), k + 1
                if compatible and depth and holder is not None:
                    compat, reps = (holder, depth), k
                node = node.children.get(ops[depth]) if depth < len(ops) else None
            if compat is not None and compat[1] > (exact.depth if exact is not None else 0):
                best, depth, kind = compat[0], compat[1], "compatible"
            elif exact is not None:
                best, depth, kind, reps = exact, exact.depth, "exact", 0
            else:
                return Match(None, 0, "miss")
            best.pins += 1  # pinned: eviction skips it while the fork below runs outside the lock
            best.last_used = time.monotonic()
            state = best.state
        try:
            fork = state.fork()
        finally:
            with self._lock:
                best.pins -= 1
        if kind == "compatible":
            try:
                with lock if lock is not None else contextlib.nullcontext():
                    unreposition(fork, reps)
            except ValueError:  # a held state whose history does not replay (never expected): use exact states
                return self.lookup(root_key, ops, lock, compatible=False)
            with self._lock:
                self.compatible_hits += 1
            if self.metrics is not None:
                self.metrics.compatible_hits.inc()
        return Match(fork, depth, kind, reps)

    # -- insertion and eviction -----------------------------------------------------------------------------------
    def insert(self, root_key, ops: list[Op], session) -> bool:
        """Store a compact copy of `session` as the state reached by `ops`; False if it alone exceeds the budget."""
        with self._lock:
            node = self._path(root_key, ops, create=True)
            node.last_used = time.monotonic()
            if node.state is not None:  # same key = same state: keep the one held
                return True
        copy = compact_copy(session)
        nbytes = copy.table.allocated_bytes()
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            node = self._path(root_key, ops, create=True)  # may have been pruned meanwhile
            if node.state is not None:
                return True
            node.state, node.nbytes, node.last_used = copy, nbytes, time.monotonic()
            self.bytes += nbytes
            self.states += 1
            self.resident_tokens += copy.resident
            self._evict_to_budget(keep=node)
            self._publish()
        return True

    def _path(self, root_key, ops: list[Op], create: bool) -> _Node | None:
        node = self._roots.get(root_key)
        if node is None:
            if not create:
                return None
            node = self._roots[root_key] = _Node()
        for op in ops:
            child = node.children.get(op)
            if child is None:
                if not create:
                    return None
                child = node.children[op] = _Node(key=op, parent=node, depth=node.depth + 1)
            node = child
        return node

    def _held(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.state is not None:
                yield node
            stack.extend(node.children.values())

    @staticmethod
    def _superseded_by_drop(node: _Node) -> bool:
        """True when a deeper held state continues from `node` through a drop: its KV still holds tokens that the
        live continuation no longer attends (AKV: dropped KV is freed before finished requests' KV)."""
        stack = [(child, child.key[0] == "drop") for child in node.children.values()]
        while stack:
            n, via_drop = stack.pop()
            if via_drop and n.state is not None:
                return True
            stack.extend((c, via_drop or c.key[0] == "drop") for c in n.children.values())
        return False

    def _evict_to_budget(self, keep: _Node) -> None:
        if self.bytes <= self.max_bytes:
            return
        # states a drop has superseded go first, then least recently used
        order = sorted(self._held(), key=lambda n: (not self._superseded_by_drop(n), n.last_used))
        for node in order:
            if self.bytes <= self.max_bytes:
                break
            if node is keep or node.pins:
                continue
            self._drop_state(node)
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.evictions.inc()

    def _drop_state(self, node: _Node) -> None:
        self.bytes -= node.nbytes
        self.states -= 1
        self.resident_tokens -= node.state.resident
        node.state, node.nbytes = None, 0
        # prune empty leaves upward; inner empty nodes stay so the states below them remain findable
        while node.parent is not None and node.state is None and not node.children:
            parent = node.parent
            del parent.children[node.key]
            node = parent
        if node.parent is None and not node.children and node.state is None:
            for k, root in list(self._roots.items()):
                if root is node:
                    del self._roots[k]

    def clear(self) -> None:
        with self._lock:
            for node in list(self._held()):
                if not node.pins:
                    self._drop_state(node)
            self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.cache_states.set(self.states)
            self.metrics.cache_bytes.set(self.bytes)
            self.metrics.cache_resident.set(self.resident_tokens)

    def node_count(self) -> int:
        with self._lock:
            count, stack = 0, list(self._roots.values())
            while stack:
                node = stack.pop()
                count += 1
                stack.extend(node.children.values())
            return count
